"""The composition root: what the sidecar will do, resolved once from the settings
(``resolve.py``: one :class:`Blueprint`), and every part built from it (``build.py``)."""

from sidecar.wiring.build import (
    Connect,
    Surface,
    build,
    health_for,
    monitor_main,
    run,
    sidecar_for,
    surface_for,
)
from sidecar.wiring.resolve import Blueprint, catalog, check, load, policy_of, problems, resolve

__all__ = [
    "Blueprint",
    "Connect",
    "Surface",
    "build",
    "catalog",
    "check",
    "health_for",
    "load",
    "monitor_main",
    "policy_of",
    "problems",
    "resolve",
    "run",
    "sidecar_for",
    "surface_for",
]
