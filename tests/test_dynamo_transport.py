"""The sidecar canaries a Dynamo worker over Dynamo's own request plane (SIDECAR_TRANSPORT=dynamo).

Every worker here is the fake Dynamo worker (``fakeengine.dynamo``): a real worker on the
real runtime, with each backend's handler rules (TensorRT-LLM decode's "Disaggregated params are
required for decode mode", SGLang decode's missing bootstrap_info) and faults. The sidecar is
started as users start it, with the worker's system server as SIDECAR_ENGINE_URL and the
worker's discovery directory; what reached the worker is read from the worker itself. Everything
runs in a private network namespace (Dynamo's event plane listens on 0.0.0.0).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.dynamo_worker import DynamoClient, FakeDynamoWorker, sidecar_env
from tests.support.exposition import metric
from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401 (a fixture)
from tests.support.processes import Shared, handed_over

BACKENDS = ("vllm", "sglang", "trtllm")
MODES = ("aggregated", "prefill", "decode")
WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0  # a hang -> 503
TRTLLM_DECODE_ERROR = "Disaggregated params are required for decode mode"


@pytest.fixture(scope="module")
def kv_dir(isolated) -> Iterator[Path]:  # noqa: F811
    with tempfile.TemporaryDirectory(prefix="dynamo-kv-") as path:
        yield Path(path)


Workers = dict[tuple[str, str], FakeDynamoWorker]


@contextlib.contextmanager
def fake_workers(kv_dir: Path) -> Iterator[Workers]:
    """One fake worker per backend and role, all in one namespace each (as a deployment's)."""
    started = {
        (backend, mode): FakeDynamoWorker(backend, mode, kv_dir=kv_dir, namespace=backend)
        for backend in BACKENDS
        for mode in MODES
    }
    try:
        for worker in started.values():
            worker.launch()
        for worker in started.values():
            worker.wait_started()
        yield started
    finally:
        for worker in started.values():
            worker.close()


@pytest.fixture(scope="module")
def workers_pool(kv_dir) -> Iterator[Shared[Workers]]:
    """The module's workers, handed to each test running, unfrozen and served."""
    with Shared("the fake Dynamo workers", lambda: fake_workers(kv_dir)) as pool:
        yield pool


workers = handed_over("workers")


@pytest.fixture(scope="module")
def client(kv_dir) -> Iterator[DynamoClient]:
    """A Dynamo runtime client of the test's own, to send what the sidecar never would."""
    dyn = DynamoClient(kv_dir)
    try:
        yield dyn.start()
    finally:
        dyn.close()


@pytest.fixture(autouse=True)
def no_faults(request) -> Iterator[None]:
    yield
    if "workers" in request.fixturenames:  # the shared workers, as this test leaves them
        for worker in request.getfixturevalue("workers_pool").current.values():
            if worker.proc is not None and worker.proc.popen.poll() is None:
                worker.fault()


def dynamo_sidecar_env(worker: FakeDynamoWorker, **extra: str) -> dict[str, str]:
    return sidecar_env(worker.system_url, worker.kv_dir, worker.backend, worker.mode, **extra)


def canaries(worker: FakeDynamoWorker, since: float = 0.0) -> list[dict[str, Any]]:
    """The sidecar's canaries that reached the worker (their context id is the canary's id)."""
    return [
        r
        for r in worker.state()["requests"]
        if r["id"].startswith("canary-") and r["started"] >= since
    ]


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses a process listens on (its socket inodes, found in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            host, port = fields[1].split(":")
            address = socket.inet_ntoa(bytes.fromhex(host)[::-1])
            found.add((address, int(port, 16)))
    return found


def answers_http(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        try:
            return sock.recv(5) == b"HTTP/"
        except (TimeoutError, ConnectionError):
            return False


def check(side: Sidecar) -> dict[str, Any]:
    return side.health()[1]["checks"]["generate"]


# --- the role matrix ------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_role_matrix_over_the_request_plane(workers, sidecar, backend, mode):
    worker = workers[(backend, mode)]
    side = sidecar(dynamo_sidecar_env(worker))
    side.wait_status(200, 10)
    body = side.health()[1]
    assert body["checks"]["generate"]["registration"].startswith(
        f"{worker.endpoint_path} instance {worker.instance_id:x}"
    )
    sent = canaries(worker)
    assert sent, "no canary reached the worker"
    assert {r["outcome"] for r in sent} == {"completed"}
    payload = sent[-1]["payload"]
    if backend == "trtllm" and mode != "aggregated":
        assert payload["disaggregated_params"] == {"request_type": "context_and_generation"}
        assert payload["_HEALTH_CHECK"] is True
    if backend == "sglang" and mode != "aggregated":
        assert payload["bootstrap_info"]["bootstrap_host"] == "2.2.2.2"

    worker.fault(hang=True)
    hung_at = time.monotonic()
    detected = side.wait_status(503, BOUND + 1)
    reason = check(side)["reason"]
    assert reason.startswith("canary timeout"), reason
    worker.fault()
    recovered = side.wait_status(200, 3)
    print(f"\nDYNAMO {backend}/{mode}: 503 after {time.monotonic() - hung_at - recovered:.2f} s "
          f"(bound {BOUND:g} s), 200 again after {recovered:.2f} s")  # fmt: skip
    assert detected <= BOUND
    # Every canary that timed out was stopped on the worker: nothing of the sidecar's runs there.
    wait_until(lambda: worker.state()["in_flight_canaries"] == 0, 2, what="no canary in flight")


# --- DIS-1737 over the real request plane ---------------------------------------------------------
@pytest.mark.engine
def test_a_plain_payload_to_trtllm_decode_is_rejected_and_the_sidecars_is_not(
    workers, client, sidecar
):
    worker = workers[("trtllm", "decode")]
    plain = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 1}}
    answer = client.call(worker.endpoint_path, plain, instance_id=worker.instance_id)
    assert TRTLLM_DECODE_ERROR in (answer["error"] or ""), answer
    assert not answer["chunks"]
    side = sidecar(dynamo_sidecar_env(worker))
    side.wait_status(200, 10)
    assert canaries(worker)[-1]["outcome"] == "completed"


@pytest.mark.engine
def test_a_rejected_canary_is_notready_with_the_workers_words_and_never_a_restart(workers, sidecar):
    """A sidecar misconfigured as vLLM beside a TensorRT-LLM decode worker sends a payload
    without disaggregated_params: the worker refuses it from the start. Notready, with the
    worker's error; and live, since a restart would be DIS-1737's crash loop."""
    worker = workers[("trtllm", "decode")]
    side = sidecar(dynamo_sidecar_env(worker, SIDECAR_BACKEND="vllm", SIDECAR_LIVENESS_WINDOW="2"))
    wait_until(
        lambda: TRTLLM_DECODE_ERROR in check(side)["reason"], 10, what="the worker's refusal"
    )
    assert side.health()[0] == 503
    assert check(side)["last_canary"]["outcome"] == "error"
    time.sleep(2.5)  # past the liveness window
    assert side.get("/live").status_code == 200
    assert check(side)["hard_failure_since"] is None


@pytest.mark.engine
def test_sglang_decode_without_bootstrap_info_is_rejected(workers, client):
    worker = workers[("sglang", "decode")]
    answer = client.call(worker.endpoint_path, {"token_ids": [1]}, instance_id=worker.instance_id)
    assert "bootstrap_info is required for disaggregated decode" in (answer["error"] or "")


# --- the deadline covers the whole stream; do no harm ---------------------------------------------
@pytest.mark.engine
def test_a_stall_after_the_first_token_is_notready(workers, sidecar):
    """Dynamo's own canary judges the first chunk only and never sees this."""
    worker = workers[("vllm", "aggregated")]
    side = sidecar(dynamo_sidecar_env(worker))
    side.wait_status(200, 10)
    worker.fault(stall_after_first=True)
    side.wait_status(503, BOUND + 1)
    assert "(1 chunk(s) arrived); stopped on the worker" in check(side)["reason"]


@pytest.mark.engine
def test_timed_out_canaries_are_stopped_on_the_worker_and_never_pile_up(workers, sidecar):
    worker = workers[("sglang", "aggregated")]
    side = sidecar(dynamo_sidecar_env(worker, SIDECAR_CANARY_RETRY_INTERVAL="0.2"))
    side.wait_status(200, 10)
    worker.fault(hang=True)
    since = time.time()
    most = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        most = max(most, worker.state()["in_flight_canaries"])
        time.sleep(0.02)
    worker.fault()
    timed_out = [r for r in canaries(worker, since) if r["outcome"] == "stopped"]
    print(f"\nDYNAMO {len(timed_out)} canaries timed out in 4 s; at most {most} ran on the worker")
    assert len(timed_out) >= 4
    # One at a time; each stopped on the worker when it timed out. The next may leave while the
    # worker's handler is still noticing the stop (the runtime delivers it in about 3 ms, the
    # handler polls every 10 ms): two for a moment, never a pile.
    assert most <= 2
    for record in timed_out:
        assert record["ended"] - record["started"] < TIMEOUT + 0.3


@pytest.mark.engine
def test_no_task_thread_or_socket_leaks_after_1000_canaries_and_100_timeouts(workers, sidecar):
    worker = workers[("vllm", "decode")]
    side = sidecar(
        dynamo_sidecar_env(
            worker,
            DYN_CANARY_WAIT_TIME="0.001",
            SIDECAR_CANARY_RETRY_INTERVAL="0.001",
            DYN_HEALTH_CHECK_REQUEST_TIMEOUT="0.05",
            SIDECAR_FAILURE_THRESHOLD="100",
        )
    )
    side.wait_status(200, 10)
    pid = side.proc.pid

    def canaries_total(outcome: str) -> float:
        text = side.metrics()
        return metric(text, "health_sidecar_canary_total", endpoint="generate", outcome=outcome)

    def footprint() -> dict[str, float]:
        text = side.metrics()
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        return {
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "tasks": metric(text, "health_sidecar_asyncio_tasks") or 0.0,
            "rss_mib": rss / 1024,
        }

    def sampled(pick: Callable[[Iterable[float]], float]) -> dict[str, float]:
        """Canaries keep running, so one reading holds whatever is in flight at that instant (a
        canary, a scrape: measured ±2 tasks): take the ceiling before and the floor after of
        ten readings, which a leak of one per hundred canaries would still lift."""
        readings = []
        for _ in range(10):
            readings.append(footprint())
            time.sleep(0.02)
        return {key: pick(r[key] for r in readings) for key in readings[0]}

    wait_until(lambda: canaries_total("success") >= 50, 30, what="50 canaries (warm-up)")
    before = sampled(max)
    start = canaries_total("success")
    wait_until(lambda: canaries_total("success") >= start + 1000, 120, what="1000 canaries")
    stopped_before = worker.state()["stopped"]
    worker.fault(hang=True)
    wait_until(lambda: canaries_total("timeout") >= 100, 60, what="100 timeouts")
    timed_out = canaries_total("timeout")
    # Each timed-out canary's stop reaches the hung worker a moment after the sidecar counts the
    # timeout; resumed sooner, a worker would finish it instead.
    wait_until(
        lambda: worker.state()["stopped"] - stopped_before >= timed_out,
        1,
        what=f"the worker to have stopped the {timed_out:.0f} timed-out canaries",
    )
    worker.fault()
    wait_until(lambda: worker.state()["in_flight_canaries"] == 0, 2, what="no canary in flight")
    time.sleep(0.5)
    after = sampled(min)
    print(
        f"\nDYNAMO footprint after 1000 canaries and 100 timeouts: before {before}, after {after}"
    )
    assert after["threads"] <= before["threads"]
    assert after["fds"] <= before["fds"] + 2
    assert after["tasks"] <= before["tasks"]
    assert after["rss_mib"] <= before["rss_mib"] + 15


# --- configuration at start -----------------------------------------------------------------------
@pytest.mark.engine
def test_the_runtime_never_sees_the_sidecars_own_variables(workers, sidecar):
    """The sidecar's fractional canary wait (refused by the runtime's parser) and its own system
    port (a runtime would start a second server there) stay the sidecar's."""
    worker = workers[("vllm", "prefill")]
    side = sidecar(dynamo_sidecar_env(worker, DYN_CANARY_WAIT_TIME="0.75"))
    side.wait_status(200, 10)
    # Its own HTTP server, and the runtime's listener for the answers the worker streams back:
    # no second system server.
    addresses = listening(side.proc.pid)
    assert ("127.0.0.1", side.port) in addresses
    others = [port for _, port in addresses if port != side.port]
    assert len(others) == 1
    assert not answers_http(others[0])
    text = side.metrics()
    assert 'transport="dynamo"' in text
    assert json.loads(side.get("/sidecar/live").text)["status"] == "live"
