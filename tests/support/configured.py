"""The sidecar's configuration as a test sets it: in-process from a clean environment, or the
command line run as users run it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from sidecar.config import Settings, load_settings
from sidecar.runtime.health import Health
from sidecar.wiring import health_for, plans_for
from tests.support.harness import ROOT, base_env


def settings_from(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    """The settings of exactly ``env``: every variable the sidecar reads is unset first."""
    for field in Settings.model_fields.values():
        monkeypatch.delenv(str(field.validation_alias), raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings()


def health_of(settings: Settings, clock: Callable[[], float] = time.monotonic) -> Health:
    """The state's writer the sidecar starts with for these settings (sidecar.wiring)."""
    return health_for(settings, plans_for(settings), clock)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m sidecar ARGS`` with the test environment plus ``env``; never raises on exit."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        env=base_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=False,
    )
