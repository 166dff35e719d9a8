"""The registration check over gRPC (SIDECAR_REGISTRATION=grpc://HOST:PORT/SERVICE): a
``grpc.health.v1.Health/Check`` of the engine's own gRPC health service, where the engine serves
one (vLLM's gRPC server does: ``vllm.entrypoints.launchers.grpc_server``, on smg-grpc-servicer,
with the services "" and ``vllm.grpc.engine.VllmEngine``).

Each check is one unary Check with its own deadline, once per registration interval, answered as
the HTTP route's answer is (:class:`Result`, read by ``core.evidence.registration``):

============================  ==========  ===============================================
the engine's answer           outcome     so
============================  ==========  ===============================================
SERVING                       success     registered
NOT_SERVING, UNKNOWN          error       deregistered (loading, draining or broken);
                                          NOT_SERVING after SERVING starts a liveness
                                          clock (the engine stays up and says so)
NOT_FOUND (no such service)   error       deregistered; the reason names the service
UNIMPLEMENTED                 error       the server serves no grpc.health.v1
UNAVAILABLE                   refused     nothing accepts connections: gone or not started
DEADLINE_EXCEEDED             timeout     no answer within the deadline (a hang's evidence)
any other status              error       the status and its details
============================  ==========  ===============================================

A Check, not a Watch: the check is a question asked on the monitor's schedule with a deadline,
so a server that stops answering is seen as a timeout, which a Watch stream that merely goes
quiet would not show.

The channel is grpcio's (grpc.aio), made on the monitor's event loop at the first check and
closed by :meth:`aclose`. Its reconnect backoff is capped at the registration interval: grpcio's
default grows to two minutes, and an engine that restarted would be seen as refused for that
long.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.core.evidence.result import Outcome, Result
from sidecar.probes.exchange import Checked
from sidecar.runtime.grpctarget import GrpcTarget

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_STATUS_NAMES = health_pb2.HealthCheckResponse.ServingStatus.Name
DETAILS_CHARS = 200


class GrpcRegistration:
    """One engine's gRPC health service, asked for one service's status."""

    def __init__(
        self, target: GrpcTarget, *, timeout: float, interval: float, clock: Callable[[], float]
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.clock = clock
        backoff_ms = max(100, int(interval * 1000))
        self._options = (
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ("grpc.enable_http_proxy", 0),  # loopback or the pod's own address: never a proxy
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: health_pb2_grpc.HealthStub | None = None

    @property
    def what(self) -> str:
        """How a reason names the question: Check('service') at host:port."""
        return f"grpc.health.v1 Check({self.target.service!r}) at {self.target.address}"

    async def __call__(self) -> Checked:
        """One Check, within the deadline; never raises for anything the engine does."""
        return Checked(await self.check())

    async def check(self) -> Result:
        """One Check's result."""
        started = self.clock()

        def result(outcome: Outcome, reason: str, *, not_serving: bool = False) -> Result:
            said = f"{self.what}: {reason}"
            return Result(
                outcome, said, started, self.clock(), time.time(), not_serving=not_serving
            )

        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target.address, options=self._options)
            self._stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=self.target.service)
        try:
            answer = await self._stub.Check(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            return result(*_refusal(exc, self.timeout))
        if answer.status == _SERVING:
            return result(Outcome.SUCCESS, "SERVING")
        said = _STATUS_NAMES(answer.status)
        return result(Outcome.ERROR, said, not_serving=answer.status == _NOT_SERVING)

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _refusal(exc: grpc.aio.AioRpcError, timeout: float) -> tuple[Outcome, str]:
    """The outcome and reason of a Check that ended with a status other than OK."""
    code = exc.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return Outcome.TIMEOUT, f"no answer within {timeout:g} s"
    if code is grpc.StatusCode.NOT_FOUND:
        return Outcome.ERROR, "NOT_FOUND (the engine knows no such service)"
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return Outcome.ERROR, "UNIMPLEMENTED (the server serves no grpc.health.v1)"
    details = " ".join((exc.details() or "").split())[:DETAILS_CHARS]
    outcome = Outcome.REFUSED if code is grpc.StatusCode.UNAVAILABLE else Outcome.ERROR
    return outcome, f"{code.name}" + (f": {details}" if details else "")
