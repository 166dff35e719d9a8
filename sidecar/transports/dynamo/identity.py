"""Which Dynamo instance is this pod's worker: read from what the worker itself publishes.

Pure functions over the worker's system server answers (tested as tables):

- its Prometheus metrics label every endpoint's ``dynamo_component_*`` series with
  ``dynamo_namespace``, ``dynamo_component``, ``dynamo_endpoint`` and ``worker_id`` (the instance
  id in hex), whatever the discovery backend;
- under Kubernetes discovery its ``/metadata`` is everything this pod registered (Dynamo's
  ``DiscoveryMetadata``: ``endpoints`` keyed "namespace/component/endpoint", each a discovery
  record with ``instance_id`` and ``transport``), which is how the sidecar reaches its worker when
  the cluster no longer lists it (a pod that is not Ready).

The instance id is read, never recomputed (under Kubernetes it is a hash of the pod's name that
Dynamo has changed between versions).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.core.evidence.progress import MetricsUnreadable, Series, matching

# Series every served endpoint publishes from the start (in flight 0), and two that follow traffic.
IDENTITY_SERIES = (
    Series("dynamo_component_inflight_requests"),
    Series("dynamo_component_requests_total"),
    Series("dynamo_component_request_duration_seconds_count"),
)


@dataclass(frozen=True, order=True)
class Instance:
    """One served endpoint of one worker."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    # The discovery record the worker advertises for it (from /metadata), when known.
    record: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def path(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    @property
    def hex(self) -> str:
        return f"{self.instance_id:x}"

    def __str__(self) -> str:
        return f"{self.path} instance {self.hex}"


def wanted(want: str, namespace: str, component: str, endpoint: str) -> bool:
    """Does an endpoint match SIDECAR_DYNAMO_ENDPOINT (a name, or namespace.component.name)?"""
    return want in (endpoint, f"{namespace}.{component}.{endpoint}")


def instances_in_metrics(text: str, want: str) -> list[Instance]:
    """The instances of the wanted endpoint that a worker's metrics name (sorted, distinct).
    Raises MetricsUnreadable."""
    found: set[Instance] = set()
    for _, sample in matching(text, IDENTITY_SERIES):
        labels = sample.labels
        names = [labels.get(k, "") for k in ("dynamo_namespace", "dynamo_component")]
        endpoint, worker = labels.get("dynamo_endpoint", ""), labels.get("worker_id", "")
        if not (all(names) and endpoint and worker) or not wanted(want, *names, endpoint):
            continue
        try:
            instance_id = int(worker, 16)
        except ValueError:
            raise MetricsUnreadable(f"worker_id {worker!r} is not a hex instance id") from None
        found.add(Instance(names[0], names[1], endpoint, instance_id))
    return sorted(found)


def instances_in_metadata(document: Any, want: str) -> list[Instance]:
    """The instances of the wanted endpoint in a worker's /metadata, each with its record.
    Raises ValueError when the document is not Dynamo's discovery metadata."""
    if not isinstance(document, dict) or not isinstance(document.get("endpoints"), dict):
        raise ValueError("no 'endpoints' object: not Dynamo's discovery metadata")
    found: dict[Instance, None] = {}
    for record in document["endpoints"].values():
        if not isinstance(record, dict) or record.get("type", "Endpoint") != "Endpoint":
            continue
        names = [record.get(k) for k in ("namespace", "component", "endpoint")]
        instance_id, transport = record.get("instance_id"), record.get("transport")
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"an endpoint record without its names: {record}")
        if not isinstance(instance_id, int) or isinstance(instance_id, bool) or instance_id < 0:
            raise ValueError(f"an endpoint record without an instance_id: {record}")
        if not isinstance(transport, dict) or not transport:
            raise ValueError(f"an endpoint record without a transport: {record}")
        namespace, component, endpoint = (str(n) for n in names)
        if wanted(want, namespace, component, endpoint):
            found[Instance(namespace, component, endpoint, instance_id, record)] = None
    return sorted(found)


def pick(found: list[Instance], want: str, where: str) -> tuple[Instance | None, str]:
    """The one instance, or None and why not (none yet, or several)."""
    if len(found) == 1:
        return found[0], f"{found[0]} ({where})"
    if not found:
        return None, f"{where} names no instance of endpoint {want!r} yet"
    listed = ", ".join(map(str, found))
    return None, (
        f"{where} names {len(found)} instances of endpoint {want!r} ({listed}): set "
        "SIDECAR_DYNAMO_ENDPOINT to namespace.component.endpoint of the one to check"
    )
