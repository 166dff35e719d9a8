"""The fake Dynamo worker (``python -m fakeengine.dynamo``) as a runtime client sees it.

Every request goes through the real Dynamo runtime: a client process
(``tests.support.dynamo_worker``)
sends it straight to one worker's instance over the TCP request plane, with a whole-answer
deadline and ``stop_generating()`` on it, as a canary does. The workers' ``/state`` shows what
reached the engine. Everything runs in a private network namespace (Dynamo's event plane
listens on 0.0.0.0); the workers are shared by the module and started together.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakeengine.dynamo import (
    HEALTH_CHECK_KEY,
    MISSING_TOKENS_ERROR,
    SGLANG_DECODE_ERROR,
    TRTLLM_DECODE_ERROR,
    canary_payload,
    greedy_tokens,
)
from tests.support.dynamo_worker import DynamoClient, FakeDynamoWorker
from tests.support.harness import wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, unhealthy

pytestmark = pytest.mark.engine

#: The module's workers: (backend, role), plus two with a job of their own.
ROLES = [
    ("vllm", "aggregated"),
    ("vllm", "decode"),
    ("vllm", "prefill"),
    ("trtllm", "decode"),
    ("trtllm", "prefill"),
    ("sglang", "decode"),
    ("sglang", "prefill"),
]
#: Dynamo's own in-process canary at its shortest period (whole seconds only).
DYNAMO_CANARY = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
}
#: How soon a held request must end on the worker after the caller's stop (the handler polls
#: every 10 ms; measured 2-10 ms; the margin is for a loaded 2-core machine).
STOP_MARGIN = 0.5
PLAIN = {"token_ids": [11, 12, 13], "stop_conditions": {"max_tokens": 2}}
REAL_BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


@dataclass
class Cluster:
    client: DynamoClient
    workers: dict[tuple[str, str], FakeDynamoWorker]
    canaried: FakeDynamoWorker  # trtllm decode, its payload registered, Dynamo's canary on
    freezable: FakeDynamoWorker  # vllm aggregated in a namespace of its own

    def call(self, worker: FakeDynamoWorker, payload: Any, **kw: Any) -> dict[str, Any]:
        return self.client.call(worker.endpoint_path, payload, instance_id=worker.instance_id, **kw)


@contextlib.contextmanager
def running_cluster(kv_dir: Path) -> Iterator[Cluster]:
    """The module's workers and client, started together; ended together."""
    workers = {role: FakeDynamoWorker(*role, kv_dir=kv_dir) for role in ROLES}
    canaried = FakeDynamoWorker(
        "trtllm",
        "decode",
        kv_dir=kv_dir,
        namespace="canaried",
        health_check_payload=True,
        env_extra=DYNAMO_CANARY,
    )
    freezable = FakeDynamoWorker("vllm", kv_dir=kv_dir, namespace="freezable")
    everyone = [*workers.values(), canaried, freezable]
    client = DynamoClient(kv_dir)
    try:
        for worker in everyone:
            worker.launch()
        client.start()
        for worker in everyone:
            worker.wait_started()
        yield Cluster(client, workers, canaried, freezable)
    finally:
        for worker in everyone:  # all at once: each takes about 0.5 s to shut down
            if worker.proc is not None:
                worker.proc.signal(signal.SIGCONT)
                worker.proc.signal(signal.SIGTERM)
        client.close()
        for worker in everyone:
            worker.close()


def cluster_unhealthy(cluster: Cluster) -> str | None:
    everyone = [*cluster.workers.values(), cluster.canaried, cluster.freezable]
    return unhealthy([cluster.client, *everyone])


@pytest.fixture(scope="module")
def cluster_pool(
    isolated: None,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Shared[Cluster]]:
    def start() -> contextlib.AbstractContextManager[Cluster]:
        return running_cluster(tmp_path_factory.mktemp("dynamo-kv"))

    with Shared("the fake Dynamo cluster", start, check=cluster_unhealthy) as pool:
        yield pool


cluster = handed_over("cluster")  # running, unfrozen and served (the last test freezes one)


@pytest.fixture
def agg(cluster: Cluster) -> Iterator[FakeDynamoWorker]:
    """The vllm aggregated worker, its faults cleared after the test."""
    worker = cluster.workers["vllm", "aggregated"]
    worker.fault()
    yield worker
    worker.fault()
    wait_until(lambda: worker.state()["in_flight"] == 0, 2, what="no request in flight")


def tokens(result: dict[str, Any]) -> list[int]:
    return [t for chunk in result["chunks"] for t in chunk["token_ids"]]


def record(worker: FakeDynamoWorker, context_id: str) -> dict[str, Any]:
    matches = [r for r in worker.state()["requests"] if r["id"] == context_id]
    assert len(matches) == 1, f"{context_id} reached the engine {len(matches)} times"
    return matches[0]


def ended(worker: FakeDynamoWorker, context_id: str, timeout: float = 1.0) -> dict[str, Any]:
    """The request's record once it has ended on the worker."""
    return wait_until(
        lambda: (r := record(worker, context_id))["outcome"] != "running" and r,
        timeout,
        what=f"{context_id} to end on the worker",
    )


def assert_answer(result: dict[str, Any], count: int) -> None:
    """``count`` one-token chunks, then the finish chunk, nothing else."""
    assert result["error"] is None, result
    assert not result["timed_out"], result
    chunks = result["chunks"]
    assert len(chunks) == count + 1, chunks
    for index, chunk in enumerate(chunks[:-1]):
        assert len(chunk["token_ids"]) == 1, chunk
        assert chunk["finish_reason"] is None, chunk
        assert chunk["completion_usage"]["completion_tokens"] == index + 1
    assert chunks[-1]["token_ids"] == []
    assert chunks[-1]["finish_reason"] == "length"


def test_each_worker_serves_its_role_endpoint_and_names_its_instance(cluster: Cluster) -> None:
    for (_, role), worker in cluster.workers.items():
        component = "prefill" if role == "prefill" else "backend"
        assert worker.endpoint_path == f"dynamo.{component}.generate"
        assert worker.instance_id in cluster.client.instances(worker.endpoint_path)
        assert worker.proc is not None
        own = [line for line in worker.proc.output().splitlines() if "fake dynamo" in line]
        assert len(own) == 1, own  # one line at start, nothing per request
        assert f"dyn://{worker.endpoint_path} instance {worker.instance_id:x}" in own[0]


def test_answer_is_greedy_one_token_per_chunk_then_length(
    cluster: Cluster, agg: FakeDynamoWorker
) -> None:
    payload = {"token_ids": [3, 1, 4], "stop_conditions": {"max_tokens": 3}}
    first, again = cluster.call(agg, payload), cluster.call(agg, payload)
    assert_answer(first, 3)
    assert tokens(first) == tokens(again) == greedy_tokens([3, 1, 4], 3)
    other = cluster.call(agg, payload | {"token_ids": [2, 7, 1]})
    assert tokens(other) != tokens(first)
    assert first["chunks"][-1]["completion_usage"]["prompt_tokens"] == 3
    assert_answer(cluster.call(agg, {"token_ids": [5]}), 1)  # max_tokens defaults to 1


def test_state_records_what_reached_the_engine(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    before = agg.state()
    payload = {"token_ids": [9], "stop_conditions": {"max_tokens": 1}, "sampling_options": {}}
    cluster.call(agg, payload, context_id="canary-state-1")
    seen = record(agg, "canary-state-1")
    assert seen["payload"] == payload
    assert seen["outcome"] == "completed"
    assert seen["started"] <= seen["ended"] <= time.time()
    after = agg.state()
    assert after["completed"] == before["completed"] + 1
    assert after["in_flight"] == 0


def test_a_request_without_token_ids_is_invalid(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    result = cluster.call(agg, {"prompt": "hi"}, context_id="canary-no-tokens")
    assert result["error"] == f"InvalidRequest: ValueError: {MISSING_TOKENS_ERROR}"
    assert result["error_type"] == "ValueError"
    assert result["chunks"] == []
    assert record(agg, "canary-no-tokens")["outcome"] == "error"


@pytest.mark.parametrize(
    "payload",
    [
        PLAIN,
        PLAIN | {HEALTH_CHECK_KEY: True},
        PLAIN | {"disaggregated_params": {"request_type": "context_and_generation"}},
    ],
    ids=["plain", "marker-only", "params-only"],
)
def test_trtllm_decode_rejects_a_request_without_marker_and_params(
    cluster: Cluster, payload: dict[str, Any]
) -> None:
    result = cluster.call(cluster.workers["trtllm", "decode"], payload)
    assert result["error"] == f"InvalidRequest: ValueError: {TRTLLM_DECODE_ERROR}"
    assert result["chunks"] == []


def test_trtllm_decode_runs_its_canary_and_a_prefilled_request(cluster: Cluster) -> None:
    decode = cluster.workers["trtllm", "decode"]
    assert_answer(cluster.call(decode, canary_payload("trtllm", "decode")), 1)
    prefilled = PLAIN | {"prefill_result": {"disaggregated_params": {"opaque_state": "x"}}}
    assert_answer(cluster.call(decode, prefilled), 2)


@pytest.mark.parametrize("backend", ["vllm", "trtllm"])
def test_prefill_answers_one_token_with_disaggregated_params(
    cluster: Cluster, backend: str
) -> None:
    result = cluster.call(cluster.workers[backend, "prefill"], PLAIN)  # max_tokens 2
    assert_answer(result, 1)
    assert isinstance(result["chunks"][0]["disaggregated_params"], dict)


def test_vllm_decode_runs_a_plain_request(cluster: Cluster) -> None:
    result = cluster.call(cluster.workers["vllm", "decode"], PLAIN)
    assert_answer(result, 2)
    assert tokens(result) == greedy_tokens(PLAIN["token_ids"], 2)


def test_sglang_decode_needs_bootstrap_info(cluster: Cluster) -> None:
    decode = cluster.workers["sglang", "decode"]
    result = cluster.call(decode, PLAIN)
    assert result["error"] == f"Internal: RuntimeError: {SGLANG_DECODE_ERROR}"
    assert_answer(cluster.call(decode, canary_payload("sglang", "decode")), 1)
    # a real bootstrap host: the KV of a prefill peer that never sends
    waiting = cluster.call(
        decode, PLAIN | {"bootstrap_info": REAL_BOOTSTRAP}, context_id="canary-peer", timeout=0.3
    )
    assert waiting["timed_out"]
    assert waiting["chunks"] == []
    assert ended(decode, "canary-peer")["outcome"] == "stopped"


def test_sglang_prefill_answers_its_canary(cluster: Cluster) -> None:
    result = cluster.call(cluster.workers["sglang", "prefill"], canary_payload("sglang", "prefill"))
    assert_answer(result, 1)
    assert result["chunks"][0]["disaggregated_params"]["bootstrap_host"] == "2.2.2.2"


@pytest.mark.parametrize(
    ("payload", "first_chunks"),
    [
        (PLAIN | {HEALTH_CHECK_KEY: True, "bootstrap_info": REAL_BOOTSTRAP}, 0),
        (PLAIN, 1),  # the real handler hands on its bootstrap info at once, then waits
    ],
    ids=["marked-real-host", "plain"],
)
def test_sglang_prefill_with_a_real_bootstrap_host_waits_until_stopped(
    cluster: Cluster, payload: dict[str, Any], first_chunks: int
) -> None:
    prefill = cluster.workers["sglang", "prefill"]
    context_id = f"canary-sglang-prefill-{first_chunks}"
    result = cluster.call(prefill, payload, context_id=context_id, timeout=0.4)
    assert result["timed_out"], result
    assert len(result["chunks"]) == first_chunks, result
    assert all(chunk["token_ids"] == [] for chunk in result["chunks"])
    assert all(chunk["finish_reason"] is None for chunk in result["chunks"])
    assert ended(prefill, context_id)["outcome"] == "stopped"
    assert prefill.state()["in_flight"] == 0


def test_error_fault(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    agg.fault(error="engine on fire")
    result = cluster.call(agg, PLAIN, context_id="canary-error")
    assert result["error"] == "Internal: RuntimeError: engine on fire"
    assert result["chunks"] == []
    assert record(agg, "canary-error")["outcome"] == "error"


def test_latency_fault_delays_every_chunk(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    agg.fault(latency=0.15)
    result = cluster.call(agg, PLAIN)
    assert_answer(result, 2)
    assert result["first_chunk_s"] >= 0.15
    assert result["elapsed_s"] >= 0.45
    assert tokens(result) == greedy_tokens(PLAIN["token_ids"], 2)


def test_wrong_tokens_fault(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    agg.fault(wrong_tokens=True)
    result = cluster.call(agg, PLAIN)
    assert_answer(result, 2)
    right = greedy_tokens(PLAIN["token_ids"], 2)
    assert all(got != want for got, want in zip(tokens(result), right, strict=True))


@pytest.mark.parametrize(("fault", "first_chunks"), [("hang", 0), ("stall_after_first", 1)])
def test_a_held_request_ends_on_the_worker_when_stopped(
    cluster: Cluster, agg: FakeDynamoWorker, fault: str, first_chunks: int
) -> None:
    agg.fault(**{fault: True})
    context_id = f"canary-{fault}"
    result = cluster.call(agg, PLAIN, context_id=context_id, timeout=0.3)
    assert result["timed_out"], result
    assert len(tokens(result)) == first_chunks, result
    seen = ended(agg, context_id)
    assert seen["outcome"] == "stopped"
    assert seen["ended"] - result["stopped_at"] < STOP_MARGIN
    state = agg.state()
    assert state["in_flight"] == 0
    assert state["in_flight_canaries"] == 0


def test_ignore_stop_keeps_a_hung_request_running(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    agg.fault(hang=True, ignore_stop=True)
    with ThreadPoolExecutor(2) as pool:
        calls = [
            pool.submit(cluster.call, agg, PLAIN, context_id=cid, timeout=0.3)
            for cid in ("canary-stuck", "user-stuck")
        ]
        assert all(call.result()["timed_out"] for call in calls)
    time.sleep(0.2)  # well past the stop
    state = agg.state()
    assert (state["in_flight"], state["in_flight_canaries"], state["in_flight_others"]) == (2, 1, 1)
    assert record(agg, "canary-stuck")["outcome"] == "running"
    agg.fault()  # the engine recovers: the held requests see their stop and end
    assert ended(agg, "canary-stuck")["outcome"] == "stopped"
    assert ended(agg, "user-stuck")["outcome"] == "stopped"


def test_a_fault_set_replaces_the_previous_one(cluster: Cluster, agg: FakeDynamoWorker) -> None:
    assert agg.fault(latency=0.1)["latency"] == 0.1
    now = agg.fault(hang=True)
    assert now["hang"]
    assert now["latency"] == 0
    cleared = agg.fault()
    assert not cleared["hang"]
    assert cleared["error"] is None
    answer = agg.http.post(f"{agg.control_url}/fault", json={"hang_forever": True})
    assert answer.status_code == 400
    assert agg.http.get(f"{agg.control_url}/fault").json() == cleared
    assert_answer(cluster.call(agg, PLAIN), 2)


def test_dynamo_own_canary_probes_with_the_registered_payload(cluster: Cluster) -> None:
    worker = cluster.canaried
    wait_until(lambda: worker.health()[0] == 200, 5, what="Dynamo's canary to pass")
    probes = [r for r in worker.state()["requests"] if r["payload"].get(HEALTH_CHECK_KEY)]
    assert probes
    assert probes[0]["payload"] == canary_payload("trtllm", "decode")
    assert probes[0]["outcome"] == "completed"
    assert not probes[0]["id"].startswith("canary-")  # Dynamo's own ids are bare UUIDs
    worker.fault(hang=True)
    try:
        wait_until(lambda: worker.health()[0] == 503, 6, what="Dynamo's canary to fail")
        state = worker.state()
        assert state["in_flight_others"] >= 1  # its timed-out probes, never stopped
    finally:
        worker.fault()
    wait_until(lambda: worker.health()[0] == 200, 4, what="Dynamo's canary to pass again")


def test_a_frozen_worker_never_answers_and_recovers_after_thaw(cluster: Cluster) -> None:
    worker = cluster.freezable
    assert_answer(cluster.call(worker, PLAIN), 2)
    worker.freeze()
    try:
        frozen = cluster.call(worker, PLAIN, timeout=0.5)
        assert frozen["timed_out"]
        assert frozen["chunks"] == []
    finally:
        worker.thaw()

    def answers() -> bool:
        result = cluster.call(worker, PLAIN, timeout=1.0)
        return result["error"] is None and not result["timed_out"]

    wait_until(answers, 5, what="an answer after thaw")
