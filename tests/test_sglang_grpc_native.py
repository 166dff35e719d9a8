"""The canary over SGLang's native gRPC service (``--grpc-port``, ``sglang.runtime.v1.
SglangService``, beside its HTTP server), on a real SGLang 0.5.23, in a private network
namespace: SIDECAR_TRANSPORT=grpc with SIDECAR_GRPC_SERVICE naming the native service, the
messages declared in ``sidecar/transports/grpc/sglang_native_pb.py`` with 0.5.23's field numbers.

Aggregated and decode (fake transfer: the canary's bootstrap_host 2.2.2.2) servers, each shared
by its tests. What SGLang's own checks say beside the verdict: its grpc.health.v1 is
unimplemented, its HealthCheck RPC echoes the last HTTP /health. Prepared by
``scripts/prepare_engines.sh --only sglang``; skipped without it (failed under CI).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from sidecar.transports.grpc.sglang import NATIVE_SERVICE
from tests.support.exposition import samples, total
from tests.support.harness import LOOPBACK, Sidecar, wait_until
from tests.support.netns import isolated  # noqa: F401  (the module's private network namespace)
from tests.support.processes import Shared, free_port, handed_over, spends, unhealthy
from tests.support.sglang_engine import SglangServer, sglang_server

pytestmark = pytest.mark.engine

WAIT, TIMEOUT = 1.0, 0.5  # conftest.FAST
BOUND = WAIT + TIMEOUT + 2.0
PREFILL_MODES = ("prefill_compute", "prefill_cache")


class Native:
    """A started SGLang and the port of its native gRPC server."""

    def __init__(self, server: SglangServer, port: int) -> None:
        self.server, self.port = server, port

    def env(self, mode: str = "aggregated", **extra: str) -> dict[str, str]:
        return {
            "DYN_HEALTH_CHECK_ENABLED": "true",
            "SIDECAR_TRANSPORT": "grpc",
            "SIDECAR_BACKEND": "sglang",
            "SIDECAR_GRPC_SERVICE": NATIVE_SERVICE,
            "SIDECAR_DISAGGREGATION_MODE": mode,
            "SIDECAR_ENGINE_URL": f"grpc://{LOOPBACK}:{self.port}",
            "SIDECAR_METRICS_URL": self.server.url,  # its HTTP server, beside
        } | extra

    def health_check_rpc(self) -> str:
        """SGLang's own HealthCheck RPC: "healthy", "unhealthy", or the status code's name."""
        import grpc
        from google.protobuf import descriptor_pool, message_factory

        import sidecar.transports.grpc.sglang_native_pb  # noqa: F401  (registers the messages)

        method = descriptor_pool.Default().FindMethodByName(f"{NATIVE_SERVICE}.HealthCheck")
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        with grpc.insecure_channel(f"{LOOPBACK}:{self.port}") as channel:
            call = channel.unary_unary(
                f"/{NATIVE_SERVICE}/HealthCheck",
                request_serializer=request.SerializeToString,
                response_deserializer=reply.FromString,
            )
            try:
                answer = call(request(), timeout=1)
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]
        return "healthy" if answer.healthy else "unhealthy"


@contextlib.contextmanager
def native(mode: str) -> Iterator[Native]:
    """A started SGLang with its native gRPC server on a free port, ended on exit."""
    port = free_port()
    with sglang_server("--grpc-port", str(port), mode=mode) as server:
        yield Native(server, port)


@pytest.fixture(scope="module")
def server_pool(isolated: None) -> Iterator[Shared[Native]]:  # noqa: F811
    check = lambda n: unhealthy(n.server)  # noqa: E731
    with Shared("SGLang --grpc-port", lambda: native("aggregated"), check) as pool:
        yield pool


server = handed_over("server")


def canaries(side: Sidecar, outcome: str) -> float:
    return total(samples(side.metrics()), "health_sidecar_canary_total", outcome=outcome)


def test_the_canary_passes_over_the_native_service(server: Native, sidecar):
    side = sidecar(server.env())
    side.wait_status(200, 15)
    check = side.health()[1]["checks"]["generate"]
    assert check["last_canary"]["outcome"] == "success", check
    assert check["registration"].endswith(f"/{NATIVE_SERVICE}/GetModelInfo -> OK")
    wait_until(lambda: check_progress(side), 5, what="its metrics read")
    latency = check["last_canary"]["latency_seconds"] * 1000
    print(f"\nSGLANG-GRPC native canary {latency:.1f} ms")


def check_progress(side: Sidecar) -> bool:
    return bool(side.health()[1]["checks"]["generate"]["progress"]["readable"])


def test_a_frozen_scheduler_is_notready_while_its_healthcheck_says_healthy(server, sidecar):
    side = sidecar(server.env())
    side.wait_status(200, 15)
    [scheduler] = server.server.scheduler_pids().values()
    own: set[str] = set()
    server.server.freeze(scheduler)
    try:
        frozen = time.monotonic()

        def notready() -> bool:
            own.add(server.health_check_rpc())
            return side.get("/health").status_code == 503

        wait_until(notready, BOUND + 5, interval=0.05, what="/health -> 503")
        took = time.monotonic() - frozen
        body = side.health()[1]
        wait_until(lambda: canaries(side, "timeout") >= 5, 15, interval=0.1, what="5 timeouts")
        side.close()
        before = samples(server.server.http.get(f"{server.server.url}/metrics").text)
    finally:
        server.server.thaw(scheduler)
    reason = body["checks"]["generate"]["last_canary"]["reason"]
    print(
        f"\nSGLANG-GRPC native scheduler frozen: notready after {took:.2f} s (bound {BOUND:g}"
        f" s): {body['reason']}; its HealthCheck RPC meanwhile: {sorted(own)}"
    )
    assert took <= BOUND
    assert f"stopped on the engine (gRPC /{NATIVE_SERVICE}/Abort -> OK)" in reason
    # Resumed: nothing of the timed-out canaries is computed (one request of the test's own).
    settle = server.server.http.post(
        f"{server.server.url}/generate",
        json={
            "input_ids": [100, 101, 102, 103, 104, 105, 106, 107],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        },
        timeout=30,
    )
    assert settle.status_code == 200
    after = samples(server.server.http.get(f"{server.server.url}/metrics").text)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # The schedulers' own count of the prompt tokens they computed (from the cache or not) and
    # of their batches: one 8-token prompt, the test's own.
    prompt = sum(moved("sglang:realtime_tokens_total", mode=m) for m in PREFILL_MODES)
    finished = moved("sglang:num_requests_total")
    print(
        f"SGLANG-GRPC across the freeze and one request of the test's own: {prompt:g} prompt "
        f"token(s) computed, {finished:g} request(s) finished"
    )
    assert prompt == 8
    assert finished == 1


def test_a_decode_server_survives_fifteen_seconds_of_canaries(isolated, sidecar):  # noqa: F811
    """A decode server given a plain request crashes its scheduler (real-sglang.md): the
    canary's fake-transfer bootstrap fields keep it alive through 15 s of canaries."""
    with native("decode") as decode:
        side = sidecar(decode.env("decode", DYN_CANARY_WAIT_TIME="0.1"))
        side.wait_status(200, 15)
        began = time.monotonic()

        def survived() -> bool:
            assert decode.server.running, "the decode server exited"
            return time.monotonic() - began >= 15

        wait_until(survived, 16, interval=0.5, what="15 s of canaries")
        passed, failed = (
            canaries(side, "success"),
            sum(canaries(side, o) for o in ("timeout", "error", "invalid", "refused")),
        )
        alive = decode.server.running
        status = side.get("/health").status_code
    print(f"\nSGLANG-GRPC native decode: {passed:g} canaries passed in 15 s, {failed:g} failed")
    assert alive
    assert status == 200
    assert failed == 0
    assert passed >= 15


@spends("server")
def test_a_killed_server_is_notready(server, sidecar):
    side = sidecar(server.env())
    side.wait_status(200, 15)
    server.server.kill()
    took = side.wait_status(503, BOUND)
    print(f"\nSGLANG-GRPC native killed: notready after {took:.2f} s: {side.health()[1]['reason']}")
