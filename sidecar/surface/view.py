"""What the surface reads: a source of snapshots (``Health`` is one), and what it says about the
worker it serves. The surface never writes state and never sees the configuration whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sidecar.core.snapshot import Snapshot


class HealthView(Protocol):
    """The newest snapshot, when the sidecar started and the clock both are on (monotonic)."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def started(self) -> float: ...

    def clock(self) -> float: ...


@dataclass(frozen=True)
class About:
    """The worker the surface serves, and its routes, as the status page and the build-info
    metric say them."""

    health_path: str = "/health"  # DYN_SYSTEM_HEALTH_PATH
    live_path: str = "/live"  # DYN_SYSTEM_LIVE_PATH
    backend: str = "vllm"
    mode: str = "aggregated"
    transport: str = "http"
    canaries: bool = False  # DYN_HEALTH_CHECK_ENABLED
    engine_url: str = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class ControlConfig:
    """The control routes' guard and limit."""

    token: str | None = None  # SIDECAR_CONTROL_TOKEN
    maintenance_max: float = 3600.0  # SIDECAR_MAINTENANCE_MAX
