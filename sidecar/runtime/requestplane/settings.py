"""What the Dynamo transport is configured with (SIDECAR_TRANSPORT=dynamo), as values: the
worker's discovery and request plane, shared with it, and the endpoint to canary."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DiscoveryBackend(StrEnum):
    """Dynamo's discovery backends a separate process can share with the worker."""

    ETCD = "etcd"
    FILE = "file"
    KUBERNETES = "kubernetes"


class PlaneKind(StrEnum):
    """DYN_REQUEST_PLANE: how requests travel to the worker."""

    TCP = "tcp"
    NATS = "nats"
    HTTP = "http"


@dataclass(frozen=True)
class PlaneConfig:
    discovery: DiscoveryBackend = DiscoveryBackend.ETCD  # DYN_DISCOVERY_BACKEND
    plane: PlaneKind = PlaneKind.TCP  # DYN_REQUEST_PLANE
    file_kv: str | None = None  # DYN_FILE_KV
    endpoint: str | None = None  # SIDECAR_DYNAMO_ENDPOINT; None: the one named generate
    debug: bool = False  # SIDECAR_LOG_LEVEL=DEBUG: the runtime's own info lines too
