"""A real SGLang (0.5.23 on the CPU) in ``--smg-grpc-mode``: the sidecar's canary over SGLang Model
Gateway's gRPC scheduler service (SIDECAR_TRANSPORT=grpc), beside SGLang's own checks.

What this module measures (tests.support.sglang_grpc says how the server runs here):

- the canary passes over ``sglang.grpc.scheduler.SglangScheduler/Generate``, registered by
  ``grpc.health.v1`` Check('');
- scheduler stopped (SIGSTOP): the canary times out and is stopped (the deadline, then Abort),
  notready within wait + timeout + 2 s, while ``grpc.health.v1`` says SERVING (for the server and
  for the service) and SGLang's own ``HealthCheck`` RPC, a 1-token generation, gives no answer
  within SMG's 5 s (its own verdict, "unhealthy", comes only after 20 s); SIGCONT: ready;
- the timed-out canaries are never computed once the scheduler resumes: SGLang's own scheduler
  counters, read from the side server's /metrics, move by one request of the test's own alone;
- a decode server (fake transfer) takes canaries every 0.25 s for 15 s and stays up: the canary
  carries the bootstrap fields a decode request needs (one without them kills the server);
- scheduler killed: the whole server exits and the sidecar turns notready.

One aggregated server for the module (about 15 s to start, 2 GB), handed to each test after a
readiness poll and spent by the last test; the decode server is a second one, started for its
test. Both run in a private network namespace (SGLang listens on all interfaces). Prepared by
``scripts/prepare_engines.sh --only sglang``; skipped without it or without root (failed under
CI). Run with ``-s`` for the figures.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.exposition import Samples, samples, total
from tests.support.harness import Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, handed_over, spends
from tests.support.sglang_grpc import SERVICE, SglangGrpcServer, grpc_env, sglang_grpc_server

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
SMG_HEALTH_TIMEOUT = 5.0  # SGLang Model Gateway's timeout for a gRPC worker's HealthCheck
DECODE_FOR = 15.0  # seconds of decode canaries
DECODE_WAIT = 0.25  # DYN_CANARY_WAIT_TIME beside the decode server
ABORT = f"stopped on the engine (gRPC /{SERVICE}/Abort -> OK)"


@pytest.fixture(scope="module")
def server_pool(isolated: None) -> Iterator[Shared[SglangGrpcServer]]:  # noqa: F811
    with Shared("SGLang gRPC", sglang_grpc_server) as pool:
        yield pool


@pytest.fixture(scope="module")
def decode_pool(isolated: None) -> Iterator[Shared[SglangGrpcServer]]:  # noqa: F811
    with Shared("SGLang gRPC decode", lambda: sglang_grpc_server(mode="decode")) as pool:
        yield pool


server = handed_over("server")
decode = handed_over("decode")


def generate(side: Sidecar) -> dict[str, Any]:
    return side.health()[1]["checks"]["generate"]


def canaries(side: Sidecar, **outcome: str) -> float:
    """How many canaries the sidecar counted (with ``outcome=...``: that ended so)."""
    return total(samples(side.metrics()), "health_sidecar_canary_total", **outcome)


def timed_out_ids(side: Sidecar) -> set[str]:
    """The request ids of the canaries that timed out, from the sidecar's history."""
    history = side.get("/debug/history").json()["canaries"]
    return {c["request_id"] for c in history if c["outcome"] == "timeout"}


def counter(parsed: Samples, name: str, **labels: str) -> float:
    """SGLang's sample ``sglang:<name>`` as the side server serves it: OpenMetrics, whose sample
    names prometheus-client writes with the colon escaped (``sglang_<name>``)."""
    return total(parsed, f"sglang:{name}", **labels) + total(parsed, f"sglang_{name}", **labels)


def work(server: SglangGrpcServer) -> dict[str, float]:
    """What the scheduler computed, by its own counters: requests taken off its queue, prompt
    tokens prefilled (computed or found in its cache), tokens decoded."""
    parsed = server.metrics()
    prefill = counter(parsed, "realtime_tokens_total", mode="prefill_compute") + counter(
        parsed, "realtime_tokens_total", mode="prefill_cache"
    )
    return {
        "scheduled": counter(parsed, "queue_time_seconds_count"),
        "prefilled": prefill,
        "decoded": counter(parsed, "realtime_tokens_total", mode="decode"),
    }


def ask_its_own_checks(server: SglangGrpcServer, said: set[str], stop: threading.Event) -> None:
    """grpc.health.v1 (the server and the service) and the HealthCheck RPC with SMG's timeout,
    again and again until ``stop``, each answer added to ``said``."""
    time.sleep(0.1)  # whatever the scheduler sent before it stopped has arrived by now
    while not stop.is_set():
        said.add(f"grpc.health.v1 '' {server.check('', timeout=1)}")
        said.add(f"grpc.health.v1 {SERVICE} {server.check(SERVICE, timeout=1)}")
        said.add(f"HealthCheck {server.health_check_rpc(timeout=SMG_HEALTH_TIMEOUT)}")


def test_the_canary_passes_over_the_scheduler_service(server, sidecar):
    side = sidecar(grpc_env(server))
    side.wait_status(200, 15)
    check = generate(side)
    assert check["last_canary"]["outcome"] == "success", check
    assert check["registration"] == f"grpc.health.v1 Check('') at {server.target}: SERVING"
    latency = check["last_canary"]["latency_seconds"] * 1000
    # Its side server serves SGLang's counters as OpenMetrics, whose sample names
    # prometheus-client writes with the colon escaped: sglang_num_running_reqs, not the
    # sglang:num_running_reqs of SGLang's HTTP /metrics (the family names keep the colon).
    answer = server.http.get(f"{server.url}/metrics")
    names = {name for name, _ in samples(answer.text)}
    print(
        f"\nSGLANG-GRPC server SERVING {server.ready_after:.1f} s after its start; canary passed "
        f"in {latency:.1f} ms; its side server's /metrics: {answer.headers['content-type']}; "
        f"the sidecar's progress: {check['progress']['detail']}"
    )
    assert answer.headers["content-type"].startswith("application/openmetrics-text")
    assert "sglang_num_running_reqs" in names
    assert "sglang:num_running_reqs" not in names
    # The sidecar reads them under those names (GrpcSglangProber.progress).
    readable = wait_until(
        lambda: generate(side)["progress"]["readable"], 5, interval=0.1, what="progress read"
    )
    assert readable


def test_a_stopped_scheduler_is_notready_while_its_own_checks_say_serving(server, sidecar):
    """Scheduler SIGSTOPped: notready within wait + timeout + 2 s, the canary stopped on the
    engine (Abort), while grpc.health.v1 says SERVING and the HealthCheck RPC gives no answer
    within SMG's 5 s; SIGCONT: ready."""
    side = sidecar(grpc_env(server))
    side.wait_status(200, 15)
    [scheduler] = server.scheduler_pids().values()
    said: set[str] = set()
    stop = threading.Event()
    asking = threading.Thread(target=ask_its_own_checks, args=(server, said, stop), daemon=True)
    server.freeze(scheduler)
    try:
        stopped = time.monotonic()
        asking.start()
        took = side.wait_status(503, BOUND + 5)
        body = side.health()[1]
        live = side.get("/live").status_code
        # One whole HealthCheck at least, with SMG's timeout, while the scheduler is stopped.
        wait_until(lambda: any(s.startswith("HealthCheck") for s in said), SMG_HEALTH_TIMEOUT + 5)
        stop.set()
        asking.join(SMG_HEALTH_TIMEOUT + 5)
        frozen = time.monotonic() - stopped
    finally:
        stop.set()
        server.thaw(scheduler)
    back = side.wait_status(200, 10)
    reason = body["checks"]["generate"]["last_canary"]["reason"]
    print(
        f"\nSGLANG-GRPC scheduler stopped: notready after {took:.2f} s (bound {BOUND:g} s): "
        f"{body['reason']}; its own checks over {frozen:.1f} s meanwhile: {sorted(said)}; "
        f"SIGCONT: ready after {back:.2f} s"
    )
    assert took <= BOUND
    assert live == 200
    assert said == {
        "grpc.health.v1 '' SERVING",
        f"grpc.health.v1 {SERVICE} SERVING",
        "HealthCheck DEADLINE_EXCEEDED",
    }
    assert ABORT in reason


def test_timed_out_canaries_are_not_computed_when_the_scheduler_resumes(server, sidecar):
    """Do no harm: with the scheduler stopped, canaries time out and are aborted; the sidecar is
    stopped too, and once the scheduler resumes and has answered one request of the test's own,
    its own counters moved by that one request alone: none of the timed-out canaries was taken
    off its queue, prefilled or decoded."""
    side = sidecar(grpc_env(server))
    side.wait_status(200, 15)
    [scheduler] = server.scheduler_pids().values()
    server.freeze(scheduler)
    try:
        timeouts = lambda: canaries(side, outcome="timeout")  # noqa: E731
        wait_until(lambda: timeouts() >= 5, 20, interval=0.1, what="five timed-out canaries")
        timed_out = timed_out_ids(side)
        side.close()
        before = work(server)  # the side server answers; the scheduler moves nothing
    finally:
        server.thaw(scheduler)
    answer = server.generate("after-the-freeze")
    # The scheduler publishes its counters about once a second: wait for the request's, then
    # as long again for anything that would come after it.
    wait_until(lambda: work(server)["scheduled"] > before["scheduled"], 10, interval=0.2)
    time.sleep(2.0)
    after = work(server)
    moved = {name: after[name] - before[name] for name in after}
    print(
        f"\nSGLANG-GRPC {len(timed_out)} canaries timed out on the stopped scheduler; after "
        f"SIGCONT and one request of the test's own its counters moved by {moved}"
    )
    assert answer["finish_reason"] == "length"
    assert len(timed_out) >= 5
    assert moved == {"scheduled": 1, "prefilled": 8, "decoded": 1}


def test_a_decode_server_survives_a_stream_of_canaries(decode, sidecar):
    """The decode canary carries SGLang's fake bootstrap peer: every DYN_CANARY_WAIT_TIME
    (0.25 s) for 15 s, each passes, and the decode server is the same one, serving, at the
    end."""
    [scheduler] = decode.scheduler_pids().values()
    side = sidecar(grpc_env(decode, DYN_CANARY_WAIT_TIME=str(DECODE_WAIT)))
    side.wait_status(200, 15)
    start, started = canaries(side, outcome="success"), canaries(side)
    seen: set[int] = set()
    deadline = time.monotonic() + DECODE_FOR
    while time.monotonic() < deadline:
        seen.add(side.get("/health").status_code)
        time.sleep(0.25)
    passed = canaries(side, outcome="success") - start
    failed = canaries(side) - started - passed
    own = decode.generate("decode-after")
    print(
        f"\nSGLANG-GRPC decode: {passed:g} canaries passed in {DECODE_FOR:g} s ({failed:g} did "
        f"not), /health {sorted(seen)}; the server still up, its scheduler the same, its own "
        f"Generate {own['finish_reason']}"
    )
    assert decode.running
    assert decode.scheduler_pids() == {0: scheduler}
    assert seen == {200}
    assert passed >= DECODE_FOR / (DECODE_WAIT + TIMEOUT) - 5
    assert failed == 0
    assert decode.check("") == "SERVING"


@spends("server")
def test_a_killed_scheduler_ends_the_server_and_the_sidecar_turns_notready(server, sidecar):
    """Last for the aggregated server: SIGKILL to the scheduler ends the whole server (its
    launcher sees the scheduler go and exits); the canary is refused and the sidecar 503."""
    side = sidecar(grpc_env(server))
    side.wait_status(200, 15)
    [scheduler] = server.scheduler_pids().values()
    os.kill(scheduler, signal.SIGKILL)
    killed = time.monotonic()
    took = side.wait_status(503, BOUND + 5)
    assert server.proc is not None
    code = server.proc.popen.wait(30)
    exited = time.monotonic() - killed
    body = side.health()[1]
    print(
        f"\nSGLANG-GRPC scheduler killed: notready after {took:.2f} s: {body['reason']}; the "
        f"server exited {code} {exited:.1f} s after the kill"
    )
    assert took <= BOUND
    assert code != 0
    assert server.check("", timeout=1) == "UNAVAILABLE"
