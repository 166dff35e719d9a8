"""The engines' gRPC generation services, faked (``--grpc-port``), one per backend, or
OpenEngine's (``--grpc-service openengine``, any of the three backends: ``grpc_openengine.py``).

Each speaks the service the real engine runs for SGLang Model Gateway, with the field's own
generated stubs (``smg_grpc_proto`` 0.4.28, imported on first use: the fake runs without the
package unless a gRPC service is asked for), and drives the same :class:`EngineState` as the HTTP
side: the same faults, counters, request log and jobs (an abort by id finds a gRPC request too).

- vllm: ``vllm.grpc.engine.VllmEngine`` (Generate, Abort, HealthCheck, GetModelInfo,
  GetServerInfo) and ``grpc.health.v1`` (``fakeengine/grpchealth.py``) on the same port, as
  ``vllm.entrypoints.launchers.grpc_server`` (smg-grpc-servicer 0.14.1) serves them.
- trtllm: ``trtllm.TrtllmService`` (Generate, Abort, HealthCheck, GetModelInfo, GetServerInfo),
  as TensorRT-LLM's SMG servicer (``tensorrt_llm/grpc/smg``) serves it.
- sglang: ``sglang.grpc.scheduler.SglangScheduler`` (Generate, Abort, HealthCheck,
  GetModelInfo): SGLang's ``--smg-grpc-mode``, the smg-grpc-servicer's scheduler service, not
  SGLang's native ``sglang.runtime.v1.SglangService`` (whose streamed output_ids are cumulative).

Rules every service shares:

- A generation is a job the engine runs apart from the RPC that asked for it (``grpc_base.Run``).
  When the client's deadline passes or it cancels, the servicer aborts the job at once (vLLM's
  servicer: AsyncLLM aborts a cancelled generate; SGLang's request manager and TensorRT-LLM's
  servicer call their abort on CancelledError), so a hung job is released and the engine shows
  nothing running; it counts as aborted, as an HTTP client that left (``/_fake/state``'s
  ``abandoned``).
- Generate and Abort are recorded in the request log (HealthCheck and GetModelInfo are not, as
  /health and /v1/models are not): method ``GRPC``, path ``/<service>/<rpc>``, the invocation
  metadata the log keeps (user-agent, x-request-id, ...) as headers, and the request as ``json``
  (``MessageToDict`` with the proto's field names, so ``json["request_id"]``).
- Faults, as the HTTP side takes them: ``hang_generation``/``hang_ranks`` hold Generate (until
  released, aborted or the client leaves), ``latency``/``prefill_seconds`` slow it,
  ``wrong_answer(s)`` change its tokens; ``dead`` and ``generation_status`` fail it as each
  backend's servicer fails (see each servicer); garbage ``wrong_token_count`` adds one to the
  final message's ``completion_tokens``, ``no_finish_reason`` empties its ``finish_reason``,
  ``empty`` and ``truncated`` end the stream with status OK but without its final ``complete``
  (the other kinds have no image on a protobuf wire and change nothing).
- In short, ``dead``: vllm INTERNAL (EngineDeadError's message), trtllm INTERNAL, sglang
  UNAVAILABLE; ``generation_status``: vllm 500 a ``complete`` with ``finish_reason "error"``,
  other statuses smg-grpc-servicer's HTTP-to-gRPC table (400 INVALID_ARGUMENT, 404 NOT_FOUND,
  408/504 DEADLINE_EXCEEDED, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, else INTERNAL), sglang
  that table, trtllm INVALID_ARGUMENT below 500, else INTERNAL. HealthCheck: vllm and trtllm
  ask only whether the engine died (a hang is invisible to them), sglang runs a generation.
- Loading: a Generate queues until the model is loaded, as on the HTTP side (vLLM and TRT-LLM open
  no port while loading in the process: see ``cli.py``).
- ``--mode encode`` has no gRPC generation service here (:func:`start` refuses it).
- ``--grpc-service`` (:data:`GRPC_SERVICES`): ``smg``, the default, serves the backend's SMG
  service above; ``openengine`` serves ``openengine.v1.Inference`` and ``openengine.v1.Control``
  instead, as TensorRT-LLM's OpenEngine server does (no grpc.health.v1 beside them; see
  ``fakeengine/grpc_openengine.py``, which imports the sidecar's declarations of the messages,
  only when asked for).

Not modelled: vLLM's NIXL ``kv_transfer_params(_json)`` (ignored: a P/D request runs locally) and
sleep mode; logprobs, n > 1, stop strings (every answer finishes "length"); the other RPCs of
each service answer UNIMPLEMENTED.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from fakeengine.grpc_base import GRACE, Servicer
from fakeengine.grpc_sglang import SglangServicer
from fakeengine.grpc_trtllm import TrtllmServicer
from fakeengine.grpc_vllm import VllmServicer
from fakeengine.grpchealth import FakeVllmHealth
from fakeengine.state import EngineState

__all__ = ["GRACE", "GRPC_SERVICES", "SERVICERS", "GrpcEngine", "check_supported", "start"]

# ------------------------------------------------------------------------------------ server

SERVICERS: dict[str, type[Servicer]] = {
    "vllm": VllmServicer,
    "trtllm": TrtllmServicer,
    "sglang": SglangServicer,
}
#: ``--grpc-service``: the backend's SMG service, or OpenEngine's two.
GRPC_SERVICES = ("smg", "openengine")


@dataclass
class GrpcEngine:
    """A running gRPC generation server: its bound port and service name."""

    server: grpc.aio.Server
    port: int
    service: str
    servicer: Servicer

    async def stop(self, grace: float | None = GRACE) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), then end what the engine still
        runs for calls that are over."""
        await self.server.stop(grace)
        await self.servicer.close()


def check_supported(backend: str, mode: str, service: str = "smg") -> str | None:
    """Why the fake serves no gRPC generation for this backend, mode and service, or None (the
    OpenEngine service is served for the same backends and modes as the SMG ones)."""
    if service not in GRPC_SERVICES:
        return f"--grpc-service {service}: not one of {', '.join(GRPC_SERVICES)}"
    if backend not in SERVICERS:
        return f"--grpc-port: no gRPC generation service for --backend {backend}"
    if mode == "encode":
        return "--grpc-port: no gRPC generation service for --mode encode"
    return None


async def start(state: EngineState, host: str, port: int, service: str = "smg") -> GrpcEngine:
    """Serve the backend's gRPC generation service (``service`` "smg"), or OpenEngine's
    ("openengine"), on host:port (0: the OS picks; the bound port is the answer's ``port``).
    vLLM's and SGLang's SMG servers also serve grpc.health.v1. Raises ValueError for a backend,
    mode or service without one, ImportError without smg_grpc_proto (SMG), RuntimeError when the
    port cannot be bound (no SO_REUSEPORT: a taken port fails)."""
    config = state.config
    refusal = check_supported(config.backend, config.mode, service)
    if refusal is not None:
        raise ValueError(refusal)
    servicer: Servicer
    if service == "openengine":
        from fakeengine.grpc_openengine import OpenEngineServicer  # the sidecar's declarations

        servicer = OpenEngineServicer(state)
    else:
        servicer = SERVICERS[config.backend](state)
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    server.add_generic_rpc_handlers((servicer.handler(),))
    if service == "smg" and config.backend in ("vllm", "sglang"):  # grpc.health.v1 beside it
        services = ("", servicer.service)
        health_pb2_grpc.add_HealthServicer_to_server(FakeVllmHealth(state, services), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    return GrpcEngine(server=server, port=bound, service=servicer.service, servicer=servicer)
