"""Hung canaries never cut the sidecar off from its engine. With 24 data-parallel ranks hung, 24
canaries wait on the engine at once; they go through a client of their own, so the
registration check and the metrics reads never wait for a connection behind them. (Sharing one
pool of six, a check cancelled by its deadline while it waited for a connection left that
connection stuck in httpcore's pool, encode/httpcore#1093: within a minute of the hang nothing
reached the engine any more, and the sidecar stayed 503 after the engine recovered.) Real
sockets and httpcore's real pool: the process tier."""

from __future__ import annotations

import time

import pytest

from tests.support.harness import wait_until

pytestmark = pytest.mark.process

RANKS = 24  # four times the pool the canaries once shared with the checks
HUNG_FOR = 15.0  # seconds: with a 1 s timeout, more rounds than it took to wedge the pool


def test_hung_ranks_never_cut_the_sidecar_off_from_its_engine(engine, sidecar):
    fake = engine("vllm", "aggregated", "--dp-size", str(RANKS))
    side = sidecar(
        {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_ENGINE_URL": fake.url,
            "SIDECAR_DP_RANKS": str(RANKS),
            "SIDECAR_MODEL": "tiny",
            "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
        }
    )
    side.wait_status(200, 10)
    fake.fault(hang_generation=True)
    side.wait_status(503, 5)
    deadline = time.monotonic() + HUNG_FOR
    while time.monotonic() < deadline:  # the hang lasts; the registration check goes on
        wait_until(lambda: side.get("/live").status_code == 200, 1, what="/live 200")
        _, body = side.health()
        registered = [c["registered"] for c in body["checks"].values()]
        assert all(registered), body["reason"]  # the engine is still seen answering
        time.sleep(0.5)  # the hang's length is what this test is about, not a wait for it
    fake.fault(hang_generation=False)
    side.wait_status(200, 5)
