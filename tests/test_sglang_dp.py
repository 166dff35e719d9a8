"""A real SGLang with two data-parallel ranks (``--dp-size 2``): the ranks counted from its metrics,
each checked with its own pinned canary and its own per-rank progress, and one rank's scheduler
frozen beside SGLang's own /health.

One server for the module (about 30 s to start, 3.4 GB), handed to each test after a readiness
poll, in a private network namespace.
Prepared by ``scripts/prepare_engines.sh --only sglang``; skipped without it or without root
(failed under CI).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.wiring import resolve
from tests.support.harness import wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over
from tests.support.sglang_engine import SglangServer, check, sglang_env, sglang_server

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
SGLANG_HEALTH_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def server_pool(isolated: None) -> Iterator[Shared[SglangServer]]:  # noqa: F811
    with Shared("SGLang with 2 DP ranks", lambda: sglang_server(dp_size=2)) as pool:
        yield pool


server = handed_over("server")


def health(side: Any) -> dict[str, Any]:
    return side.http.get(f"{side.url}/health", timeout=5).json()


def test_ranks_are_counted_and_each_gets_its_own_canary_and_progress(server, sidecar):
    side = sidecar(sglang_env(server, SIDECAR_DP_RANKS="auto"))
    wait_until(lambda: "ranks" in health(side), 30, what="the ranks counted from the metrics")
    side.wait_status(200, 30)
    body = health(side)
    assert body["ranks"]["generate"]["count"] == 2
    assert body["reason"] == "generate: 2 of 2 ranks ready"
    for rank in (0, 1):
        unit = f"generate/rank{rank}"
        wait_until(lambda u=unit: check(side, u)["progress"]["readable"], 5, what=f"{unit} read")
        detail = check(side, unit)["progress"]["detail"]
        # Its own series only: the schedulers', labelled with its rank.
        assert f'mode="prefill_compute",dp_rank="{rank}"' in detail, detail
        assert "sglang:num_requests_total" not in detail  # the tokenizer's counters name no rank
        assert check(side, unit)["last_canary"]["outcome"] == "success"
    # The rank-1 canary is pinned by data_parallel_rank, and the real server runs it there.
    plan = resolve(Settings.model_validate(sglang_env(server))).plan.for_rank(1)
    pinned = plan.request(None, "canary-pinned").body
    assert pinned["data_parallel_rank"] == 1
    answer = server.generate(pinned)
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["dp_rank"] == 1


def own_health(server: SglangServer, result: dict[str, Any]) -> None:
    start = time.monotonic()
    status = server.status("/health", timeout=SGLANG_HEALTH_TIMEOUT + 10)
    result |= {"status": status, "after": time.monotonic() - start}


def test_one_frozen_rank_is_named_notready_or_degraded_while_sglangs_own_health_waits(
    server, sidecar
):
    side = sidecar(sglang_env(server, SIDECAR_DP_RANKS="auto"))
    lenient = sidecar(sglang_env(server, SIDECAR_DP_RANKS="auto", SIDECAR_DP_MIN_READY_RANKS="1"))
    for each in (side, lenient):
        wait_until(lambda s=each: "ranks" in health(s), 30, what="the ranks")
        each.wait_status(200, 30)
    pid = server.scheduler_pids()[1]
    own: list[dict[str, Any]] = [{}, {}]
    askers = [threading.Thread(target=own_health, args=(server, r), daemon=True) for r in own]
    server.freeze(pid)
    try:
        for asker in askers:  # two asks: round robin sends one of them to the frozen rank
            asker.start()
        detected = side.wait_status(503, BOUND + 1)
        body = health(side)
        wait_until(
            lambda: health(lenient)["reason"].startswith("generate: degraded"),
            BOUND + 1,
            what="the lenient sidecar degraded",
        )
        degraded = health(lenient)
        for asker in askers:
            asker.join(SGLANG_HEALTH_TIMEOUT + 12)
    finally:
        server.thaw(pid)
    recovered = side.wait_status(200, 10)
    print(
        f"\nREAL-SGLANG rank 1 frozen: sidecar 503 after {detected:.2f} s: {body['reason'][:140]}"
        f"\n  with one rank required: {degraded['reason'][:120]}"
        f"\n  SGLang's own /health: "
        + ", ".join(f"{r['status']} after {r['after']:.1f} s" for r in own)
        + f"\n  SIGCONT: 200 after {recovered:.2f} s"
    )
    assert detected <= BOUND
    assert body["reason"].startswith("generate: 1 of 2 ranks ready, 2 required; generate/rank1:")
    assert body["ranks"]["generate"]["notready"] == ["generate/rank1"]
    assert degraded["status"] == "ready"
    assert degraded["reason"].startswith("generate: degraded: 1 of 2 ranks ready, 1 required")
    # SGLang's own /health never said 503 before its 20 s timeout: any output within it (the
    # other rank's) is a 200.
    for answer in own:
        assert answer["status"] == 200 or answer["after"] >= SGLANG_HEALTH_TIMEOUT - 1, own
