"""An engine's gRPC service, from the sidecar: the canary's channel, and the registration check
where the server has no grpc.health.v1 (SIDECAR_TRANSPORT=grpc; the OpenEngine transport calls
through it too).

The messages are the engines' own, from the stubs SGLang Model Gateway publishes
(``smg-grpc-proto``: vLLM's ``VllmEngine``, SGLang's ``SglangScheduler``, TensorRT-LLM's
``TrtllmService``) or the sidecar's own declarations (SGLang's native service, OpenEngine),
registered by the prober before the channel is made (``GrpcProber.messages``), and only with a
transport that needs them. A request goes by its full
method name (``/vllm.grpc.engine.VllmEngine/Generate``): the method's descriptor, found in the
stubs' descriptor pool, says its message types and whether the server streams; the body, a dict
as the prober built it, is mapped onto the request message (protobuf's JSON mapping, field names
as in the proto), and each message of the answer back into a dict. So a prober never touches
protobuf, and a user's DYN_HEALTH_CHECK_PAYLOAD is mapped the same way.

The deadline is grpcio's own, over the whole call: a server that misses it sees the call
cancelled (vLLM's and SGLang's servicers abort the request then). Nothing here raises for what
the engine does, or judges: the statuses become outcomes, as the registration check's do
(:mod:`sidecar.runtime.grpcregistration`):

======================  ==========  ===============================================
status                  outcome     so
======================  ==========  ===============================================
OK                      (answer)    the messages, for the probe to judge
DEADLINE_EXCEEDED       timeout     no whole answer within the deadline
UNAVAILABLE             refused     nothing accepts connections (gone, or starting)
INVALID_ARGUMENT,       error       the engine refused the request itself (a
FAILED_PRECONDITION,                rejection: TensorRT-LLM decode without
NOT_FOUND, UNIMPLEMENTED            disaggregated_params)
any other               error       the status and its details
======================  ==========  ===============================================
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.message import Message

from sidecar.core.evidence.result import Outcome, Result
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import Checked, NoAnswer, Received, Streamed
from sidecar.runtime.grpctarget import GrpcTarget

# More messages than a canary of a few tokens can need: a server streaming on and on is broken.
MAX_MESSAGES = 256
DETAILS_CHARS = 200
_REJECTIONS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def _details(exc: grpc.aio.AioRpcError) -> str:
    details = " ".join((exc.details() or "").split())
    return details[:DETAILS_CHARS] + ("..." if len(details) > DETAILS_CHARS else "")


def refusal(exc: grpc.aio.AioRpcError, deadline: float, what: str) -> NoAnswer:
    """What a call that ended with a status other than OK received."""
    code = exc.code()
    said = f"{what} -> {code.name}" + (f": {_details(exc)}" if _details(exc) else "")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return NoAnswer(
            Outcome.TIMEOUT, f"no complete answer within {deadline:g} s ({what})", status=code.name
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return NoAnswer(Outcome.REFUSED, said, status=code.name)
    return NoAnswer(Outcome.ERROR, said, rejection=code in _REJECTIONS, status=code.name)


class GrpcEngine:
    """One engine's gRPC server (I/O): a channel made on the monitor's loop at the first call,
    closed by :meth:`aclose`. The messages of the services it calls are registered in protobuf's
    default pool before it is made."""

    def __init__(
        self,
        target: GrpcTarget,
        *,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.clock = clock
        self._pool = descriptor_pool.Default()
        backoff_ms = max(100, int(interval * 1000))
        self._options = (
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ("grpc.enable_http_proxy", 0),  # loopback or the pod's own address: never a proxy
        )
        self._channel: grpc.aio.Channel | None = None

    def _method(self, path: str) -> tuple[type[Message], type[Message], bool]:
        """The request and response classes of ``/package.Service/Method``, and whether the
        server streams."""
        service, _, name = path.removeprefix("/").rpartition("/")
        method = self._pool.FindMethodByName(f"{service}.{name}")
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        return request, response, method.server_streaming

    def check_payload(self, request: CanaryRequest) -> None:
        """A user's DYN_HEALTH_CHECK_PAYLOAD, checked once at start: it must be a request of
        the method; raises StartupError naming the variable and what does not fit."""
        from sidecar.runtime.server import StartupError

        try:
            self.message(request)
        except ValueError as exc:
            raise StartupError(
                f"DYN_HEALTH_CHECK_PAYLOAD: expected a request of {request.path} (the proto's "
                f"field names): {' '.join(str(exc).split())}"
            ) from None

    def message(self, request: CanaryRequest) -> Message:
        """The request message of a canary (its body mapped onto the method's request type);
        raises ValueError naming what does not fit."""
        kind, _, _ = self._method(request.path)
        try:
            return json_format.ParseDict(request.body, kind())
        except json_format.ParseError as exc:
            said = " ".join(str(exc).split())
            raise ValueError(said.split(" Available Fields")[0]) from None

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        """The canary's channel (:class:`sidecar.probes.exchange.Channel`): one call of
        ``request.path`` with ``request.body``, every message of its answer within
        ``deadline``."""
        started = self.clock()

        def received(answer: Streamed | NoAnswer) -> Received:
            return Received(answer, started, self.clock(), time.time())

        what = request.path
        try:
            kind, reply, streams = self._method(request.path)
            message = json_format.ParseDict(request.body, kind())
        except (KeyError, json_format.ParseError) as exc:
            return received(NoAnswer(Outcome.ERROR, f"{what}: cannot build the request: {exc}"))
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.target.address, options=self._options)
        metadata = (("x-request-id", request.request_id),) if request.request_id else None
        messages: list[dict[str, Any]] = []
        try:
            if streams:
                call = self._channel.unary_stream(
                    what,
                    request_serializer=kind.SerializeToString,
                    response_deserializer=reply.FromString,
                )(message, timeout=deadline, metadata=metadata)
                try:
                    async for answer in call:
                        messages.append(_as_dict(answer))
                        if len(messages) > MAX_MESSAGES:
                            return received(
                                NoAnswer(Outcome.INVALID, f"more than {MAX_MESSAGES} messages")
                            )
                finally:
                    call.cancel()  # a no-op once it ended; else the server sees it go
            else:
                answer = await self._channel.unary_unary(
                    what,
                    request_serializer=kind.SerializeToString,
                    response_deserializer=reply.FromString,
                )(message, timeout=deadline, metadata=metadata)
                messages.append(_as_dict(answer))
        except grpc.aio.AioRpcError as exc:
            return received(refusal(exc, deadline, what))
        except UnreadableMessage as exc:
            return received(NoAnswer(Outcome.INVALID, f"{what}: an unreadable message ({exc})"))
        return received(Streamed(tuple(messages)))

    def redact(self, text: str) -> str:
        return text  # no secret goes over this channel

    async def registration(self, path: str, deadline: float) -> Result:
        """A registration check where the server serves no grpc.health.v1: a unary call of
        ``path`` (GetModelInfo) with an empty request, registered while it answers OK."""
        started = self.clock()
        got = (await self.send(CanaryRequest("gRPC", path, {}, "", None), deadline)).answer
        if isinstance(got, NoAnswer):
            outcome, reason = got.outcome, got.reason
        else:
            outcome, reason = Outcome.SUCCESS, f"{path} -> OK"
        return Result(outcome, reason, started, self.clock(), time.time())

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class RpcRegistration:
    """The registration check as the monitor calls it: :meth:`GrpcEngine.registration` of one
    method (the engine owns, and closes, the channel)."""

    def __init__(self, engine: GrpcEngine, path: str, *, timeout: float) -> None:
        self.engine = engine
        self.path = path
        self.timeout = timeout

    async def __call__(self) -> Checked:
        return Checked(await self.engine.registration(self.path, self.timeout))

    async def aclose(self) -> None:
        """Nothing of its own to close."""


class UnreadableMessage(ValueError):
    """A message that decoded but that no JSON mapping reads (a map key that is not UTF-8, in a
    message declared proto2): the answer is invalid."""


def _as_dict(message: Message) -> dict[str, Any]:
    """A message as a dict: the proto's field names, unset fields absent (a oneof shows the one it
    holds), 64-bit integers as strings (protobuf's JSON mapping; token ids are 32-bit)."""
    try:
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True, use_integers_for_enums=False
        )
    except json_format.Error as exc:
        raise UnreadableMessage(" ".join(str(exc).split())[:DETAILS_CHARS]) from None
