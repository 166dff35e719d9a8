"""llm-d's endpoint picker keeps only the pods whose sidecar says ready (deploy/llm-d/).

The EPP (llm-d-router) cannot run here, so the example is checked offline: its wiring read from
the YAML, and its custom metric's selector evaluated against a real sidecar's ``/metrics`` with
the semantics of llm-d-router's ``pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go``
(at ebab687927f5): a PromQL instant-vector selector with fixed labels (``name{label="value"}``,
unquoted values allowed); a series matches when it has every label of the selector with that
value, whatever other labels it has; of several matches the one with the latest timestamp wins,
the first on a tie (no timestamps: the first); only gauges and counters have a value.

- The wiring: the filter reads the attribute the sidecar's extractor fills from the sidecar's port
  every 200 ms, drops endpoints without it and never falls back to unready ones, and the engine's
  own metrics stay on the engine's port (docs/deploy/llm-d.md).
- Against a sidecar started with config/vllm-aggregated.env (the profile whose port the example
  scrapes; the engine's URL set apart): 1 while the engine serves, 0 while its generation hangs,
  1 again after.
- With data-parallel ranks behind one port, the pod-level gauge is what a selector can use; a
  per-rank selector gives every endpoint of the pod the same rank's value.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from dotenv import dotenv_values
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.harness import FakeEngine, Sidecar, wait_until

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "llm-d" / "epp-config.yaml"
PROFILE = ROOT / "config" / "vllm-aggregated.env"
COMPONENT = ROOT / "deploy" / "kubernetes" / "components" / "health-sidecar"
SIDECAR_CONTAINER = "health-sidecar"


# --- the selector, as spec.go reads it ---------------------------------------------------------
_QUOTE = re.compile(r"(\w+)\s*=\s*([^\",}\s]+)")
_SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
_PAIR = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class Selector:
    """A custom metric's ``metricSpec``: a metric name and fixed labels."""

    name: str
    labels: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Selector:
        quoted = _QUOTE.sub(r'\1="\2"', text)  # {rank=1} reads as {rank="1"}
        found = _SPEC.match(quoted)
        assert found is not None, f"not a metric specification: {text!r}"
        assert _METRIC_NAME.match(found.group(1)), f"not a metric name: {text!r}"
        labels: dict[str, str] = {}
        if block := (found.group(2) or "").strip():
            for pair in block.split(","):
                matched = _PAIR.match(pair)
                assert matched is not None, f"invalid label pair {pair!r} in {text!r}"
                assert _LABEL_NAME.match(matched.group(1)), f"invalid label name in {text!r}"
                labels[matched.group(1)] = matched.group(2)
        return cls(found.group(1), labels)

    def matches(self, exposition: str) -> list[Sample]:
        """The series the selector matches, in exposition order. A gauge's or a counter's series
        carries the name of its family (``x_total`` for a counter: Go's parser keys families by
        the name the exposition gives them)."""
        found = []
        for family in text_string_to_metric_families(exposition):
            if family.type not in ("gauge", "counter"):
                continue
            for sample in family.samples:
                wanted = self.labels.items() <= sample.labels.items()
                if sample.name == self.name and wanted:
                    found.append(sample)
        return found

    def value(self, exposition: str) -> float | None:
        """What the extractor puts in the attribute: the latest match's value (None: no match,
        the attribute is left as it was)."""
        latest: Sample | None = None
        recent = -1.0
        for sample in self.matches(exposition):
            stamp = float(sample.timestamp or 0)
            if stamp > recent:
                latest, recent = sample, stamp
        return None if latest is None else float(latest.value)

    def only_value(self, exposition: str) -> float:
        """The value of the one series the selector matches (several: the selector is ambiguous)."""
        found = self.matches(exposition)
        assert len(found) == 1, f"{self} matches {len(found)} series: {found}"
        return float(found[0].value)


# --- the example -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """``deploy/llm-d/epp-config.yaml`` as the EPP's loader sees it: plugins by name (a plugin
    without a name is named after its type), the data layer's sources, the default profile."""

    config: dict[str, Any]

    @classmethod
    def load(cls) -> Example:
        return cls(yaml.safe_load(EXAMPLE.read_text(encoding="utf-8")))

    @property
    def plugins(self) -> dict[str, dict[str, Any]]:
        return {p.get("name") or p["type"]: p for p in self.config["plugins"]}

    def params(self, name: str) -> dict[str, Any]:
        return self.plugins[name].get("parameters") or {}

    @property
    def sources(self) -> dict[str, list[str]]:
        """Source name -> the names of its extractors."""
        return {
            s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]]
            for s in self.config["dataLayer"]["sources"]
        }

    @property
    def profile(self) -> list[str]:
        (profile,) = self.config["schedulingProfiles"]
        return [p["pluginRef"] for p in profile["plugins"]]

    @property
    def filter_name(self) -> str:
        (name,) = [
            n for n in self.profile if self.plugins[n]["type"] == "endpoint-attribute-filter"
        ]
        return name

    def producer_of(self, attribute: str) -> tuple[str, str, dict[str, Any]]:
        """(source, extractor, custom metric) that fill ``attribute`` for a pod without an
        engine label (the mapping every pod gets from the extractor's defaultEngine)."""
        found = []
        for source, extractors in self.sources.items():
            for extractor in extractors:
                params = self.params(extractor)
                default = params.get("defaultEngine", "vllm")
                for engine in params.get("engineConfigs", []):
                    for custom in engine.get("customMetrics", []):
                        if custom["attributeKey"] == attribute and engine["name"] == default:
                            found.append((source, extractor, custom))
        assert len(found) == 1, f"{attribute}: produced by {found}"
        return found[0]

    def selector(self) -> Selector:
        attribute = self.params(self.filter_name)["attribute"]
        return Selector.parse(self.producer_of(attribute)[2]["metricSpec"])


def sidecar_port_of_the_component() -> int:
    """The port the Component's sidecar container serves and the engine's probes target."""
    sidecar = yaml.safe_load((COMPONENT / "sidecar.yaml").read_text(encoding="utf-8"))
    (container,) = [
        c
        for c in sidecar["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == SIDECAR_CONTAINER
    ]
    (port,) = [p["containerPort"] for p in container["ports"]]
    probes = yaml.safe_load((COMPONENT / "engine-probes.yaml").read_text(encoding="utf-8"))
    readiness = next(p["value"] for p in probes if p["path"].endswith("/readinessProbe"))
    assert readiness["httpGet"] == {"path": "/health", "port": port}
    return int(port)


@pytest.mark.unit
def test_the_example_filters_on_the_sidecars_readiness_read_from_its_port_every_200ms() -> None:
    example = Example.load()
    assert example.config["apiVersion"] == "llm-d.ai/v1alpha1"
    assert example.config["kind"] == "EndpointPickerConfig"

    # The filter runs first in the profile, and fails closed.
    assert example.profile[0] == example.filter_name
    parameters = example.params(example.filter_name)
    assert parameters["onMissing"] == "Fail"
    assert parameters["fallbackOnEmpty"] is False
    assert parameters["algorithm"] == {
        "type": "threshold",
        "threshold": {"operator": "Equal", "value": 1},
    }
    assert "producer" not in parameters  # the core metrics extractor's custom metric

    # Its attribute comes from the sidecar's port, every 200 ms, with no engine metric on it.
    source, extractor, _ = example.producer_of(parameters["attribute"])
    assert example.plugins[source]["type"] == "metrics-data-source"
    assert example.plugins[extractor]["type"] == "core-metrics-extractor"
    scrape = example.params(source)
    profile_port = int(dotenv_values(PROFILE)["DYN_SYSTEM_PORT"] or 0)
    assert scrape["port"] == profile_port == sidecar_port_of_the_component()
    assert scrape.get("path", "/metrics") == "/metrics"
    assert scrape["interval"] == "200ms"
    (engine,) = example.params(extractor)["engineConfigs"]
    assert set(engine) == {"name", "customMetrics"}
    assert example.selector() == Selector("health_sidecar_ready", {})

    # The engine's own metrics are still scraped on the target port (no port override), by a
    # source named after its type, so that the loader injects no third one.
    assert example.sources["metrics-data-source"] == ["core-metrics-extractor"]
    assert "port" not in example.params("metrics-data-source")
    assert example.plugins["metrics-data-source"]["type"] == "metrics-data-source"
    assert example.params("core-metrics-extractor") == {}


@pytest.mark.unit
def test_the_selector_reads_as_llm_d_reads_it() -> None:
    exposition = (
        "# TYPE g gauge\n"
        'g{endpoint="generate",rank="0"} 1.0\n'
        'g{endpoint="generate",rank="1"} 0.0\n'
        "# TYPE c_total counter\n"
        "c_total 7.0\n"
        "# TYPE h histogram\n"
        'h_bucket{le="+Inf"} 1.0\n'
        "h_count 1.0\n"
        "h_sum 0.5\n"
    )
    assert Selector.parse("g{rank=1}") == Selector("g", {"rank": "1"})
    assert Selector.parse(' g { rank = "1" , endpoint=generate } ').labels == {
        "rank": "1",
        "endpoint": "generate",
    }
    assert Selector.parse("g{rank=1}").only_value(exposition) == 0.0
    assert Selector.parse("g").value(exposition) == 1.0  # two match: the first, no timestamps
    assert len(Selector.parse("g").matches(exposition)) == 2
    assert Selector.parse("g{rank=2}").value(exposition) is None
    assert Selector.parse("c_total").only_value(exposition) == 7.0
    assert Selector.parse("h_count").value(exposition) is None  # histograms have no value here


# --- against a real sidecar --------------------------------------------------------------------
def until_reads(side: Sidecar, selector: Selector, value: float, timeout: float) -> None:
    """Poll the sidecar's /metrics until the selector matches one series, of ``value``."""

    def reads() -> bool:
        found = selector.matches(side.metrics())
        return len(found) == 1 and found[0].value == value

    wait_until(reads, timeout, interval=0.1, what=f"{selector} to read {value}")


@pytest.mark.process
def test_the_example_reads_1_while_the_engine_serves_and_0_while_its_generation_hangs(
    engine: Callable[..., FakeEngine], sidecar: Callable[..., Sidecar]
) -> None:
    fake = engine("vllm")
    side = sidecar({"SIDECAR_ENGINE_URL": fake.url}, "--env-file", str(PROFILE))
    selector = Example.load().selector()

    until_reads(side, selector, 1.0, 15)
    assert side.get("/health").status_code == 200

    fake.fault(hang_generation=True)
    until_reads(side, selector, 0.0, 15)  # the next canary times out
    status, body = side.health()
    assert status == 503
    assert "canary timeout" in body["reason"]

    fake.fault(hang_generation=False)
    until_reads(side, selector, 1.0, 15)
    assert side.get("/health").status_code == 200


@pytest.mark.process
def test_with_ranks_behind_one_port_a_fixed_selector_reads_one_rank_for_every_endpoint(
    engine: Callable[..., FakeEngine], sidecar: Callable[..., Sidecar]
) -> None:
    """A pod whose engine serves 2 ranks on one port, one of them wedged, kept ready by
    SIDECAR_DP_MIN_READY_RANKS=1: the pod-level gauge says 1 (the pod keeps its traffic, the
    wedged rank's share too). In a pool with one target port per rank, the EPP would give every
    rank's endpoint the same selector on the same scrape: without a rank label the first series
    (rank 0's, ready), with one the same rank's for all."""
    fake = engine("vllm", "aggregated", "--dp-size", "2")
    side = sidecar(
        {"SIDECAR_ENGINE_URL": fake.url, "SIDECAR_DP_MIN_READY_RANKS": "1"},
        "--env-file",
        str(PROFILE),
    )
    rank = {r: Selector("health_sidecar_rank_ready", {"rank": str(r)}) for r in (0, 1)}
    until_reads(side, rank[1], 1.0, 15)  # the ranks are counted and both pass

    fake.fault(hang_ranks=[1])
    until_reads(side, rank[1], 0.0, 15)
    exposition = side.metrics()
    assert Example.load().selector().only_value(exposition) == 1.0
    assert rank[0].only_value(exposition) == 1.0
    unlabelled = Selector("health_sidecar_rank_ready", {})
    assert len(unlabelled.matches(exposition)) == 2
    assert unlabelled.value(exposition) == 1.0  # rank 0's value, for rank 1's endpoint as well
    status, body = side.health()
    assert status == 200
    assert body["reason"].startswith("generate: degraded: 1 of 2 ranks ready, 1 required")
