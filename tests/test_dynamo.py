"""The real Dynamo mocker worker (``python -m dynamo.mocker``, ai-dynamo 1.6.1), two of them in one
namespace, and the sidecar watching one: its canaries go over the request plane to that worker's
instance only, never through a frontend or a router.

The mocker registers no canary payload of its own, so its own /health says 503 "notready" for
its whole life (the second seed's bug, still in 1.6.1): the sidecar says ready, and shows the
worker's answer beside. Everything runs in a private network namespace (Dynamo's event plane
listens on 0.0.0.0).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.dynamo_worker import sidecar_env
from tests.support.engines import MockerWorker
from tests.support.harness import Sidecar, wait_until
from tests.support.metadata_proxy import MetadataProxy
from tests.support.netns import isolated  # noqa: F401 (a fixture)
from tests.support.processes import Shared, handed_over, spends, started

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
LEASE = 10.0  # the file discovery's record TTL


@pytest.fixture(scope="module")
def kv_dir(isolated) -> Iterator[Path]:  # noqa: F811
    with tempfile.TemporaryDirectory(prefix="dynamo-kv-") as path:
        yield Path(path)


@pytest.fixture(scope="module")
def other_pool(kv_dir) -> Iterator[Shared[MockerWorker]]:
    """The second worker of the namespace, which the sidecar under test never canaries."""
    with Shared("the other mocker", lambda: started(MockerWorker(kv_dir, "other"))) as pool:
        yield pool


other = handed_over("other")


@pytest.fixture(scope="module")
def mine_pool(kv_dir) -> Iterator[Shared[MockerWorker]]:
    with Shared("this pod's mocker", lambda: started(MockerWorker(kv_dir, "mine"))) as pool:
        yield pool


@pytest.fixture
def mine(mine_pool: Shared[MockerWorker], other, request: pytest.FixtureRequest) -> MockerWorker:
    """This pod's worker: a test that ends it (kills it, orphans it, takes its record away)
    spends it, and the next test gets a fresh one."""
    return mine_pool.hand_over(request)


def env(worker: MockerWorker, **extra: str) -> dict[str, str]:
    return sidecar_env(worker.system_url, worker.kv_dir, **extra)


def reason(side: Sidecar) -> str:
    return side.health()[1]["reason"]


def stays(side: Sidecar, code: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert side.health()[0] == code, reason(side)
        time.sleep(0.1)


def test_the_sidecar_canaries_its_own_worker_and_sees_its_freeze_alone(mine, other, sidecar):
    side = sidecar(env(mine))
    beside = sidecar(env(other))  # the other worker's own sidecar: it serves on
    side.wait_status(200, 15)
    beside.wait_status(200, 15)
    body = side.health()[1]
    check = body["checks"]["generate"]
    assert check["registration"].startswith(
        f"dynamo.backend.generate instance {mine.instance_id:x}"
    )
    assert check["discovery"]["listed"] is True
    # The mocker's own /health is 503 forever (no canary payload); the sidecar shows it, beside.
    worker_status, worker_body = mine.health()
    assert worker_status == 503
    assert check["engine_health"]["status_code"] == 503
    assert check["engine_health_agrees"] is False
    assert "the worker's own health route says GET /health -> 503 (notready)" in body["reason"]
    assert "ms" in check["last_canary"]["reason"] or check["last_canary"]["outcome"] == "success"

    mine.freeze()
    frozen_at = time.monotonic()
    detected = side.wait_status(503, BOUND + 1)
    print(
        f"\nDYNAMO mocker frozen: sidecar 503 after {detected:.2f} s (bound {BOUND:g} s); its "
        f"own /health: {mine.health()}; the other worker's sidecar: {beside.health()[0]}"
    )
    assert detected <= BOUND
    assert reason(side).startswith("generate: canary timeout"), reason(side)
    assert beside.health()[0] == 200
    mine.thaw()
    recovered = side.wait_status(200, 5)
    print(
        f"DYNAMO mocker thawed after {time.monotonic() - frozen_at:.1f} s: 200 in {recovered:.2f} s"
    )

    # The other worker frozen changes nothing for this pod's sidecar.
    other.freeze()
    try:
        stays(side, 200, 3)
        assert beside.wait_status(503, BOUND + 1) <= BOUND
    finally:
        other.thaw()
    beside.wait_status(200, 5)
    print(f"DYNAMO worker {worker_body[:100]}")


@spends("mine")
def test_a_worker_frozen_past_its_lease_is_an_orphan_not_discoverable_and_not_live(mine, sidecar):
    side = sidecar(env(mine, SIDECAR_LIVENESS_WINDOW="3"))
    side.wait_status(200, 15)
    mine.freeze()
    side.wait_status(503, BOUND + 1)
    wait_until(lambda: not mine.record().exists(), LEASE + 10, interval=0.2, what="records expire")
    mine.thaw()
    # Alive again, its system server answers and its own /health names its endpoints; no request
    # can reach it ever again: the sidecar says so, and /live fails after the window.
    wait_until(
        lambda: "not discoverable" in reason(side), 10, interval=0.1, what="'not discoverable'"
    )
    status, own = mine.health()
    assert status is not None
    assert json.loads(own)["endpoints"]["generate"] == "ready"
    assert side.health()[0] == 503
    assert "gone from file discovery" in reason(side)
    not_live = side.wait_status(503, 3 + 3, path="/live")
    live = side.get("/live").json()
    print(
        f"\nDYNAMO orphan: its own /health {status} {own[:90]}\n  sidecar: {reason(side)}\n"
        f"  /live 503 after {not_live:.1f} s more: {live['reason'][:120]}"
    )
    assert live["cause"] == "not discoverable"
    assert side.metrics().count('health_sidecar_endpoint_discoverable{endpoint="generate"} 0.0')


@spends("mine")
def test_a_killed_worker_is_notready(mine, sidecar):
    side = sidecar(env(mine))
    side.wait_status(200, 15)
    mine.kill()
    detected = side.wait_status(503, 3)
    assert "engine not registered" in reason(side), reason(side)
    assert "cannot connect" in reason(side)
    print(f"\nDYNAMO mocker killed: 503 after {detected:.2f} s: {reason(side)}")
    assert side.get("/live").status_code == 200  # gone is not hung: never restarted for it


@pytest.fixture
def proxy(mine) -> Iterator[str]:
    """The worker's system server as Kubernetes discovery serves it (with /metadata)."""
    with started(MetadataProxy(mine.system_url, mine.kv_dir)) as proxy:
        yield proxy.url


@spends("mine")
def test_under_kubernetes_discovery_the_canary_reaches_the_worker_by_its_own_record(
    mine, proxy, sidecar
):
    """A pod that is not Ready is no longer listed by the cluster, so a canary that found its
    worker through the cluster would never see it recover. The sidecar reaches it by the record
    the worker advertises on its own /metadata, in a discovery directory of its own."""
    side = sidecar(
        env(mine, DYN_DISCOVERY_BACKEND="kubernetes", SIDECAR_ENGINE_URL=proxy)
        | {"DYN_FILE_KV": ""}  # unset: nothing of the shared directory is read
    )
    side.wait_status(200, 15)
    check = side.health()[1]["checks"]["generate"]
    assert check["discovery"] is None or check["discovery"]["listed"] is None
    assert check["registration"].endswith("(GET /metadata)")
    # The worker's record leaves the shared discovery (as a notready pod leaves the cluster's):
    # the canary still reaches it, sees its freeze, and sees it recover.
    mine.record().unlink()
    stays(side, 200, 2)
    mine.freeze()
    side.wait_status(503, BOUND + 1)
    mine.thaw()
    recovered = side.wait_status(200, 5)
    print(
        f"\nDYNAMO kubernetes path: not listed, frozen -> 503, thawed -> 200 in {recovered:.2f} s"
    )
