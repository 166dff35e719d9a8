"""``health-sidecar probes``: the engine container's Kubernetes probes, sized from the
configuration. (Placeholder: filled in by the deployment work.)"""

from __future__ import annotations

from sidecar.config import Settings


def render(settings: Settings, max_load_seconds: float) -> str:
    raise NotImplementedError
