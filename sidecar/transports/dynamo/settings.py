"""What the Dynamo transport's client is configured with, as values: the worker's discovery and
request plane, shared with it, and the endpoint to canary."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config import DiscoveryBackend, PlaneKind


@dataclass(frozen=True)
class PlaneConfig:
    discovery: DiscoveryBackend = DiscoveryBackend.ETCD  # DYN_DISCOVERY_BACKEND
    plane: PlaneKind = PlaneKind.TCP  # DYN_REQUEST_PLANE
    file_kv: str | None = None  # DYN_FILE_KV
    endpoint: str | None = None  # SIDECAR_DYNAMO_ENDPOINT; None: the one named generate
    debug: bool = False  # SIDECAR_LOG_LEVEL=DEBUG: the runtime's own info lines too
