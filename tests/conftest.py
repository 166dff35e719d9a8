from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.harness import FakeEngine, Sidecar

# Short timings keep the suite fast and steady on a busy 2-core machine.
FAST = {
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
}


@pytest.fixture
def engine() -> Iterator[Callable[..., FakeEngine]]:
    """Start fake engines; every one is ended when the test ends, pass or fail."""
    started: list[FakeEngine] = []

    def start(backend: str, mode: str = "aggregated", *extra: str) -> FakeEngine:
        fake = FakeEngine(backend, mode, *extra)
        started.append(fake)
        return fake.start()

    yield start
    for fake in reversed(started):
        fake.close()


@pytest.fixture
def sidecar() -> Iterator[Callable[..., Sidecar]]:
    """Start sidecars as users do (python -m sidecar); ended when the test ends."""
    started: list[Sidecar] = []

    def start(env: dict[str, str], *argv: str, wait: bool = True) -> Sidecar:
        proc = Sidecar(FAST | env, argv)
        started.append(proc)
        return proc.wait_serving() if wait else proc

    yield start
    for proc in reversed(started):
        proc.close()
