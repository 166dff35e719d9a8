"""vLLM's gRPC health service, faked (``--grpc-health-port``, vllm only).

vLLM's gRPC server (``python -m vllm.entrypoints.launchers.grpc_server``, on smg-grpc-servicer
0.14) serves ``grpc.health.v1.Health`` with two services, "" (the server as a whole) and
``vllm.grpc.engine.VllmEngine``; both answer what ``AsyncLLM.check_health()`` says: SERVING
unless the engine died. An unknown service is refused with NOT_FOUND ("Unknown service: ...")
on Check; Watch yields the current status once and ends. This one answers the same from the
fake's state, the HTTP /health's faults included:

- NOT_SERVING while loading, when ``dead``, or with ``health_status`` at 300 or above;
- ``health_latency`` delays the answer, as it delays /health;
- a hung generation (``hang_generation``, ``hang_ranks``) leaves it SERVING, as a wedged
  EngineCore leaves vLLM's check_health (which only asks whether the engine errored).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fakeengine.state import EngineState

ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"
SERVICES = ("", ENGINE_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
GRACE = 0.5  # seconds calls in flight get at shutdown


class FakeVllmHealth(health_pb2_grpc.HealthServicer):
    """``services``: the names it knows; SGLang's --smg-grpc-mode server (smg-grpc-servicer's
    SGLangHealthServicer) serves "" and ``sglang.grpc.scheduler.SglangScheduler`` the same way."""

    def __init__(self, state: EngineState, services: tuple[str, ...] = SERVICES) -> None:
        self.state = state
        self.services = services

    async def _status(self, service: str) -> int | None:
        if service not in self.services:
            return None
        faults = self.state.faults
        if faults.health_latency:
            await asyncio.sleep(faults.health_latency)
        forced = faults.health_status
        if self.state.loading or faults.dead or (forced is not None and forced >= 300):
            return NOT_SERVING
        return SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.state.grpc_checks += 1
        status = await self._status(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"Unknown service: {request.service}")
            return health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        status = await self._status(request.service)
        yield health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN if status is None else status)


async def start(state: EngineState, host: str, port: int) -> grpc.aio.Server:
    """Serve the fake health service on host:port (no SO_REUSEPORT: a taken port fails)."""
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    health_pb2_grpc.add_HealthServicer_to_server(FakeVllmHealth(state), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server.add_insecure_port(address)  # raises RuntimeError when it cannot bind
    await server.start()
    return server
