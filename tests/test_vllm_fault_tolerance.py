"""vLLM's fault tolerance read as evidence, on a real vLLM: an engine fault that vLLM catches
and reports on ``GET /fault_tolerance/status`` while its own ``/health`` says 200.

Fault tolerance runs only with external-LB data parallel (one API server per rank), which vLLM
allows only for MoE models, so the pair is two ranks of a tiny random-weight Mixtral
(``tests.support.vllm_engine.ft_pair``). A fault is a RuntimeError raised in each rank's engine
step (the sitecustomize's opt-in trigger), caught by vLLM's ``fault_tolerant_wrapper``: the
engine aborts its requests, reports ``unhealthy`` with ``fault_info`` "RuntimeError", and waits
for ``POST /fault_tolerance/apply {"instruction": "retry"}``. Both ranks fault together and both
are told to retry: recovery rebuilds the data-parallel group, which needs every rank (measured:
rank 0 faulted alone, its retry waited for rank 1, which, healthy, refused to retry; see
docs/engines.md).

The sitecustomize makes the ranks agree on an injected fault (in the MoE layer's all-gather), so
that both raise at the same step; a rank that raised alone would leave the other waiting in that
collective. Last, a fault nobody injects: rank 1 killed, rank 0's next collective fails and
vLLM reports rank 0 unhealthy.

Each rank has its own sidecar, as each rank's pod would. One pair for the module (about 75 s to
start), handed to each test after a readiness poll that also asks each rank's fault-tolerance
status (a faulted engine's /health says 200), and spent by the last test; in a private network
namespace (a Worker's torch.distributed store listens on every
interface). Prepared by ``scripts/prepare_engines.sh --only vllm``; skipped without it or without
root (failed under CI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import pytest

from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.vllm_engine import FaultTolerantRank, ft_pair

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 1.0
REGISTRATION_INTERVAL = 0.5  # the fault-tolerance status is read with each registration check
# A notready verdict needs one registration check after the fault, and the fault fires with the
# engine's next step, which the next canary brings: wait + interval, plus scheduling slack.
DETECT_BOUND = WAIT + REGISTRATION_INTERVAL + 2.0
RECOVER_BOUND = REGISTRATION_INTERVAL + WAIT + TIMEOUT + 3.0  # status healthy, then a canary
T = TypeVar("T")


Pair = tuple[FaultTolerantRank, FaultTolerantRank]


@pytest.fixture(scope="module")
def pair_pool(
    isolated: None,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Shared[Pair]]:
    def start() -> AbstractContextManager[Pair]:  # a fresh trigger directory each start
        return ft_pair(tmp_path_factory.mktemp("ft-trigger"))

    with Shared("vLLM fault-tolerant pair", start) as pool:
        yield pool


pair = handed_over("pair")


def env(rank: FaultTolerantRank) -> dict[str, str]:
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "vllm",
        "SIDECAR_ENGINE_URL": rank.url,
        "DYN_CANARY_WAIT_TIME": str(WAIT),
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": str(TIMEOUT),
        "SIDECAR_REGISTRATION_INTERVAL": str(REGISTRATION_INTERVAL),
        "SIDECAR_LIVENESS_WINDOW": "600",  # longer than the test: /live must stay 200
    }


def health(side: Sidecar) -> dict[str, Any]:
    return side.http.get(f"{side.url}/health", timeout=5).json()


def fault_tolerance(side: Sidecar) -> dict[str, Any]:
    return health(side)["checks"]["generate"]["fault_tolerance"]


def test_each_rank_reports_healthy_and_its_sidecar_is_ready(pair, sidecar):
    for rank in pair:
        assert rank.ft_status()["engines"] == [{"id": rank.rank, "status": "healthy"}]
        side = sidecar(env(rank))
        side.wait_status(200, 30)
        wait_until(lambda side=side: fault_tolerance(side), 10, what="the status read")
        assert fault_tolerance(side) == {
            "engine": rank.rank,
            "state": "healthy",
            "detail": None,
            "unhealthy_since": None,
        }


def test_an_engine_fault_is_notready_behind_a_200_health_until_retry(pair, sidecar):
    sides = [sidecar(env(rank)) for rank in pair]
    for side in sides:
        side.wait_status(200, 30)
    vllm_health: list[int | None] = []  # vLLM's own /health, both ranks, all along

    def watch(condition: Callable[[], T]) -> T:
        vllm_health.extend(rank.health() for rank in pair)
        return condition()

    for rank in pair:
        rank.inject_fault()
    faulted = time.monotonic()
    detected = [0.0, 0.0]
    for i, side in enumerate(sides):
        wait_until(
            lambda side=side: watch(lambda: side.get("/health").status_code == 503),
            DETECT_BOUND + 5,
            interval=0.05,
            what=f"rank {i}'s sidecar to answer 503",
        )
        detected[i] = time.monotonic() - faulted
    assert not any(rank.fault_pending for rank in pair)  # both triggers fired
    for rank, side in zip(pair, sides, strict=True):
        assert rank.ft_state() == "unhealthy"
        body = health(side)
        assert body["status"] == "notready"
        want = f"vLLM fault tolerance: engine {rank.rank} reports unhealthy (RuntimeError)"
        assert body["reason"] == f"generate: {want}", body["reason"]
        check = body["checks"]["generate"]["fault_tolerance"]
        assert check["state"] == "unhealthy", check
        assert check["engine"] == rank.rank, check
        assert check["detail"] == "RuntimeError", check
        assert check["unhealthy_since"], check
        assert rank.health() == 200  # vLLM's own /health sees nothing
        assert side.get("/live").status_code == 200  # within the liveness window
    # It stays so: a few more registration checks and canaries.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for side in sides:
            assert watch(lambda side=side: side.get("/health").status_code) == 503
            assert side.get("/live").status_code == 200
        time.sleep(0.25)

    retried = time.monotonic()
    for rank in pair:  # every rank: recovery rebuilds the data-parallel group
        assert rank.retry().status_code == 202
    healthy = wait_until(
        lambda: watch(lambda: all(rank.ft_state() == "healthy" for rank in pair)),
        30,
        interval=0.05,
        what="both engines to report healthy",
    )
    assert healthy
    status_healthy = time.monotonic() - retried
    recovered = [0.0, 0.0]
    for i, side in enumerate(sides):
        wait_until(
            lambda side=side: watch(lambda: side.get("/health").status_code == 200),
            RECOVER_BOUND + 5,
            interval=0.05,
            what=f"rank {i}'s sidecar to answer 200 again",
        )
        recovered[i] = time.monotonic() - retried
    for side in sides:
        assert health(side)["checks"]["generate"]["fault_tolerance"]["state"] == "healthy"
        assert health(side)["checks"]["generate"]["last_canary"]["outcome"] == "success"

    print(
        "REAL-VLLM FT: fault -> sidecar 503 in "
        + ", ".join(f"rank {i} {t:.2f} s" for i, t in enumerate(detected))
        + f"; retry -> status healthy in {status_healthy:.2f} s, sidecar 200 in "
        + ", ".join(f"rank {i} {t:.2f} s" for i, t in enumerate(recovered))
        + f"; vLLM /health meanwhile: {sorted(set(vllm_health), key=str)} "
        f"({len(vllm_health)} reads)"
    )
    assert vllm_health
    assert set(vllm_health) == {200}
    assert max(detected) <= DETECT_BOUND, detected
    assert max(recovered) <= RECOVER_BOUND, recovered


def test_the_engines_serve_again_after_the_retry(pair):
    for rank in pair:
        body = {"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 1}
        answer = rank.complete(body | {"temperature": 0, "ignore_eos": True}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"


@spends("pair")
def test_a_killed_peer_rank_is_a_fault_the_survivor_reports(pair, sidecar):
    """No injected fault: rank 1's processes killed, rank 0's next step fails in a collective
    with it ("Connection reset by peer"), which vLLM's fault tolerance catches. Last in the
    module: the pair does not recover."""
    rank0, rank1 = pair
    side = sidecar(env(rank0))
    side.wait_status(200, 30)
    rank1.kill()
    killed = time.monotonic()
    vllm_health: list[int | None] = []

    def notready() -> bool:
        vllm_health.append(rank0.health())
        return side.get("/health").status_code == 503

    wait_until(notready, 30, interval=0.05, what="rank 0's sidecar to answer 503")
    took = time.monotonic() - killed
    body = health(side)
    check = body["checks"]["generate"]["fault_tolerance"]
    print(
        f"REAL-VLLM FT: rank 1 killed -> rank 0's sidecar 503 in {took:.2f} s: {body['reason']}; "
        f"rank 0's /health meanwhile: {sorted(set(vllm_health), key=str)}"
    )
    assert check["state"] in {"unhealthy", "dead"}, body
    assert body["reason"].startswith(
        f"generate: vLLM fault tolerance: engine 0 reports {check['state']}"
    ), body["reason"]
    assert side.get("/live").status_code == 200
