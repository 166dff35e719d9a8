"""A real SGLang (0.5.23, its CPU engine) serving SGLang Model Gateway's gRPC scheduler service:
``--smg-grpc-mode`` (smg-grpc-servicer 0.14.1), on loopback inside a private network namespace.

``python -m sglang.launch_server --smg-grpc-mode`` serves no HTTP API: the launcher runs the
servicer of ``sglang.grpc.scheduler.SglangScheduler`` (Generate, HealthCheck, Abort, ...) and
``grpc.health.v1`` on ``--port``, and, with ``--enable-metrics``, an HTTP side server on the port
+ 1 whose only route of use here is ``/metrics`` (SGLang's own counters, as over HTTP). Below it
run the same ``sglang::scheduler`` and ``sglang::detokenizer`` as in HTTP mode: freezing the
scheduler (SIGSTOP) is a hung engine, killing it ends the whole server.

``scripts/prepare_engines.sh --only sglang`` puts smg-grpc-servicer, grpcio and protobuf (the
sglang venv has neither of the two) in ``SGLANG_GRPC_DIR``, on ``PYTHONPATH`` after the site
directory. The flags are :data:`tests.support.sglang_engine.BASE_FLAGS` and
``--skip-server-warmup``: the servicer's warm-up request sends hard-coded token ids up to 890,
which the tiny model's 512-token vocabulary does not have (its scheduler dies on it:
``IndexError: index out of range in self`` in the embedding); skipped, the server says SERVING
as soon as its scheduler is up (about 15 s here). What its own checks say (measured here):

- ``grpc.health.v1`` Check("") is a flag set at start-up: SERVING for as long as the launcher
  lives, a frozen scheduler or not; Check(the service) adds one rule, NOT_SERVING once the
  scheduler has pushed nothing for 30 s with a request pending (22.7 s after a SIGSTOP once);
  with nothing pending it stays SERVING (still after 37 s frozen);
- its ``HealthCheck`` RPC submits a 1-token generation and answers healthy at the scheduler's
  next push of anything (0.5 s), and with the scheduler frozen "unhealthy: Health check timeout
  after 20s" only after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20.1 s);
- ``Abort`` answers success in 2-3 ms, the scheduler frozen or not, and the work stops: a
  queued request is never prefilled, a running one stops decoding. The aborted ``Generate``
  itself is never ended, though: it stays open until the client's own deadline;
- scheduler killed: the gRPC port refuses within a second and the launcher exits 1 in about 3 s.

Start it only inside ``tests.support.netns`` (the module fixture ``isolated``), as
:mod:`tests.support.sglang_engine`: the scheduler opens a listener on all interfaces.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

from sidecar.probes.base import PROMPT_TOKEN_IDS
from tests.support.engines import require
from tests.support.processes import LOOPBACK, free_port, free_port_in
from tests.support.sglang_engine import FAKE_BOOTSTRAP_HOST, SglangServer

SERVICE = "sglang.grpc.scheduler.SglangScheduler"  # SglangScheduler's full name
HEALTH_CHECK_TIMEOUT = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT: its HealthCheck gives up after this


def _port_pair() -> int:
    """A free port whose successor (the side server's default) is free too; both reserved."""
    for _ in range(50):
        port = free_port()
        with contextlib.suppress(RuntimeError):
            free_port_in(port + 1, port + 1)
            return port
    raise RuntimeError("no two consecutive free ports")


class SglangGrpcServer(SglangServer):
    """``python -m sglang.launch_server --smg-grpc-mode`` on a free loopback port (its HTTP side
    server on the next one), in ``mode`` "aggregated" or "decode" (the fake transfer backend: a
    request needs ``disaggregated_params`` with the bootstrap host 2.2.2.2)."""

    def __init__(self, *extra: str, mode: str = "aggregated") -> None:
        if mode not in ("aggregated", "decode"):
            raise ValueError(f"mode {mode!r}: aggregated or decode")
        super().__init__(*extra, mode=mode)
        self.paths |= require("SGLANG_GRPC_DIR")
        self.port = _port_pair()

    @property
    def name(self) -> str:
        return f"sglang-grpc-{self.mode}"

    @property
    def target(self) -> str:
        """Where the gRPC server listens (host:port)."""
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        """Its HTTP side server (``/metrics``): the gRPC port + 1."""
        return f"http://{self.host}:{self.port + 1}"

    def env(self) -> dict[str, str]:
        env = super().env()
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.paths["SGLANG_SITE_DIR"], self.paths["SGLANG_GRPC_DIR"]) if p
        )
        return env

    def argv(self) -> list[str]:
        return [*super().argv(), "--smg-grpc-mode", "--skip-server-warmup"]

    def ready(self) -> bool:
        """grpc.health.v1 says SERVING for the server, and the side server serves /metrics."""
        if self.check("", timeout=1) != "SERVING":
            return False
        return self.status("/metrics") == 200

    # --- its gRPC services ----------------------------------------------------------------
    def _stub(self, channel: Any) -> Any:
        from smg_grpc_proto import sglang_scheduler_pb2_grpc

        return sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)

    def check(self, service: str = "", timeout: float = 2) -> str:
        """A grpc.health.v1 Check: the status's name, or the call's status code's name."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))

    def health_check_rpc(self, timeout: float = 5) -> str:
        """SGLang's own ``SglangScheduler/HealthCheck`` (what SGLang Model Gateway asks a gRPC
        worker, with a 5 s timeout by default): "healthy", "unhealthy: <message>", or the call's
        status code's name. It submits a generation of its own (input [0], 1 token)."""
        import grpc
        from smg_grpc_proto import sglang_scheduler_pb2 as pb

        with grpc.insecure_channel(self.target) as channel:
            try:
                answer = self._stub(channel).HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]
        return "healthy" if answer.healthy else f"unhealthy: {answer.message}"

    def generate(  # type: ignore[override]
        self, request_id: str, max_new_tokens: int = 2, timeout: float = 30
    ) -> dict[str, Any]:
        """One greedy Generate of the canary's prompt from a client of the test's own (the fake
        bootstrap peer on a decode server): its ``complete`` message as a dict."""
        import grpc
        from google.protobuf import json_format
        from smg_grpc_proto import sglang_scheduler_pb2 as pb

        request = pb.GenerateRequest(
            request_id=request_id,
            tokenized=pb.TokenizedInput(input_ids=list(PROMPT_TOKEN_IDS), original_text=""),
            sampling_params=pb.SamplingParams(
                temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True
            ),
            stream=False,
        )
        if self.mode == "decode":
            request.disaggregated_params.CopyFrom(
                pb.DisaggregatedParams(
                    bootstrap_host=FAKE_BOOTSTRAP_HOST,
                    bootstrap_port=8998,
                    bootstrap_room=random.getrandbits(31),
                )
            )
        with grpc.insecure_channel(self.target) as channel:
            (answer,) = list(self._stub(channel).Generate(request, timeout=timeout))
        return json_format.MessageToDict(answer.complete, preserving_proto_field_name=True)

    def abort(self, request_id: str, timeout: float = 5) -> dict[str, Any]:
        """``SglangScheduler/Abort`` of ``request_id``: its answer as a dict."""
        import grpc
        from google.protobuf import json_format
        from smg_grpc_proto import sglang_scheduler_pb2 as pb

        with grpc.insecure_channel(self.target) as channel:
            answer = self._stub(channel).Abort(
                pb.AbortRequest(request_id=request_id), timeout=timeout
            )
        return json_format.MessageToDict(answer, preserving_proto_field_name=True)


@contextlib.contextmanager
def sglang_grpc_server(*extra: str, mode: str = "aggregated") -> Iterator[SglangGrpcServer]:
    """One started SGLang gRPC server, ended on exit: wrap it in a module-scoped fixture that
    depends on ``isolated`` (its private network namespace)."""
    server = SglangGrpcServer(*extra, mode=mode)
    try:
        server.start()
        yield server
    finally:
        server.close()


def grpc_env(server: SglangGrpcServer, **extra: str) -> dict[str, str]:
    """The sidecar as config/sglang-grpc.env configures it beside this server: canaries over the
    scheduler service, progress from the side server's /metrics."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_TRANSPORT": "grpc",
        "SIDECAR_BACKEND": "sglang",
        "SIDECAR_DISAGGREGATION_MODE": server.mode,
        "SIDECAR_ENGINE_URL": f"grpc://{server.target}",
        "SIDECAR_METRICS_URL": server.url,
    } | extra
