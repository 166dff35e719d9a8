"""The sidecar's configuration as a test sets it: in-process from a clean environment, or the
command line run as users run it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import NoAnswer
from sidecar.runtime.health import Health
from sidecar.wiring import Blueprint, check, health_for, load, resolve
from tests.support.harness import ROOT, base_env


def settings_from(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    """The settings of exactly ``env``: every variable the sidecar reads is unset first."""
    for field in Settings.model_fields.values():
        monkeypatch.delenv(str(field.validation_alias), raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load()


def blueprint_from(monkeypatch: pytest.MonkeyPatch, **env: str) -> Blueprint:
    """What the sidecar resolves from exactly ``env`` (:func:`settings_from`)."""
    return resolve(settings_from(monkeypatch, **env))


def blueprint_of(**fields: object) -> Blueprint:
    """What the sidecar resolves from settings given by field name (``backend="sglang"``),
    checked as the loader checks them; the process environment is not read."""
    settings = Settings.model_validate(
        {str(Settings.model_fields[k].validation_alias): v for k, v in fields.items()}
    )
    problems = check(settings)
    assert not problems, problems
    return resolve(settings)


def health_of(settings: Settings, clock: Callable[[], float] = time.monotonic) -> Health:
    """The state's writer the sidecar starts with for these settings (sidecar.wiring)."""
    return health_for(resolve(settings), clock)


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


def answered_by(channel: Any, path: str) -> Callable[[float], Awaitable[bool]]:
    """A canary probe's ``answers`` over a test's channel: its route ``path`` answers at all,
    within the deadline (as the HTTP transport asks the engine client)."""

    async def answers(deadline: float) -> bool:
        got = await channel.send(CanaryRequest("GET", path, {}, "", None), deadline)
        return not isinstance(got.answer, NoAnswer)

    return answers
