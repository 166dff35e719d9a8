"""Reading what the sidecar (or an engine) exposes at /metrics, with prometheus-client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Prometheus text -> {(sample name, labels): value} (prometheus-client's parser)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric_names(text: str) -> set[str]:
    """Every family and sample name in Prometheus text."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def total(parsed: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in parsed.items() if n == name and want <= ls)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels are exactly ``labels``; None when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None
