"""What the fake gRPC generation services share (``fakeengine/grpcengine.py`` says what they
are): the servicer base on the engine state, a job run apart from the RPC that asked for it, the
request log, the faults that end a call before it is parsed, and smg-grpc-servicer's table of
HTTP statuses to gRPC codes. smg_grpc_proto is imported on first use (:func:`protos`)."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Final

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from fakeengine.backends import BACKENDS
from fakeengine.backends.base import Backend
from fakeengine.state import EngineState, Job

#: Seconds the calls in flight get when the server stops.
GRACE = 0.5
#: The request log's method for a gRPC call.
GRPC_METHOD = "GRPC"
STOPPING_MESSAGE = "The engine is shutting down"
#: The fake's vocabulary as GetModelInfo gives it (the tiny model's, measured over vLLM's
#: GetModelInfo); every token the fake generates is below it.
VOCAB_SIZE = 367
#: The context length the fake's vLLM serves (VllmBackend.max_model_len).
MAX_CONTEXT_LENGTH = 2048
#: smg-grpc-servicer's table of an engine's HTTP status to the gRPC status it ends a stream
#: with (engine_status.grpc_code_for_http_status); INTERNAL for any other status, 500 included.
HTTP_TO_GRPC: Final = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
#: The ids SGLang gives its own health-check generations (they are never aborted by id).
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"


def grpc_code_for_http_status(status: int) -> grpc.StatusCode:
    return HTTP_TO_GRPC.get(status, grpc.StatusCode.INTERNAL)


def protos(name: str) -> ModuleType:
    """smg_grpc_proto's generated module ``name``, imported on first use."""
    return importlib.import_module(f"smg_grpc_proto.generated.{name}")


# ------------------------------------------------------------------------------ one generation

_END: Final = object()
Context = grpc.aio.ServicerContext


class Run:
    """One job as the engine runs it: a task of its own, apart from the RPC that asked for it,
    handing its tokens over a queue. The RPC that leaves before the end (its client cancelled or
    its deadline passed) aborts the job (:meth:`leave`), which then ends at its next step."""

    def __init__(self, state: EngineState, job: Job, tasks: set[asyncio.Future[Any]]) -> None:
        self.job = job
        self.tokens: list[int] = []
        self.ended = False
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(state))
        tasks.add(self._task)
        self._task.add_done_callback(tasks.discard)

    async def _pump(self, state: EngineState) -> None:
        try:
            async for token in state.generate(self.job):
                self._queue.put_nowait(token)
        except Exception as exc:  # EngineStopping, or a bug: the RPC reports it
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(_END)

    async def stream(self) -> AsyncIterator[int]:
        """The tokens as the engine makes them; ends with the job (``job.finish_reason`` says
        how); raises what ended it otherwise (EngineStopping at shutdown)."""
        while True:
            item = await self._queue.get()
            if item is _END:
                self.ended = True
                return
            if isinstance(item, Exception):
                self.ended = True
                raise item
            assert isinstance(item, int)
            self.tokens.append(item)
            yield item

    def leave(self) -> None:
        """The RPC is over: a job still running loses its client and is aborted."""
        if not self.ended:
            self.ended = True
            self.job.client_gone = True
            self.job.abort.set()


# ------------------------------------------------------------------------------ servicer base

Handler = Callable[[Any, Context], Any]


@dataclass(frozen=True)
class Method:
    behaviour: Handler
    request: type[Message]
    response: type[Message]
    streaming: bool = False


class Servicer:
    """What the three services share: the state, the request log, jobs run apart, the handler
    table, faults that end a call before it is parsed."""

    backend: ClassVar[str]
    module: ClassVar[str]  # the generated module in smg_grpc_proto
    service_name: ClassVar[str]  # the service's name in that module's proto
    # The service's methods this fake serves, each by the method of the same name (the others
    # answer UNIMPLEMENTED).
    rpcs: ClassVar[tuple[str, ...]] = ("Generate", "Abort", "HealthCheck", "GetModelInfo")

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.pb = protos(self.module)
        self.service: str = self.pb.DESCRIPTOR.services_by_name[self.service_name].full_name
        # The HTTP side's backend: its messages (death, ranks) and role rules' side effects.
        self.http: Backend = BACKENDS[self.backend](state)
        self._tasks: set[asyncio.Future[Any]] = set()

    def methods(self) -> dict[str, Method]:
        """Each served method, its messages and streaming as the proto declares them."""
        service = self.pb.DESCRIPTOR.services_by_name[self.service_name]
        table = {}
        for name in self.rpcs:
            declared = service.methods_by_name[name]
            table[name] = Method(
                getattr(self, name),
                getattr(self.pb, declared.input_type.name),
                getattr(self.pb, declared.output_type.name),
                declared.server_streaming,
            )
        return table

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for name, method in self.methods().items():
            make = (
                grpc.unary_stream_rpc_method_handler
                if method.streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[name] = make(
                method.behaviour,
                request_deserializer=method.request.FromString,
                response_serializer=method.response.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(self.service, handlers)

    async def close(self) -> None:
        """End what the engine still runs for calls that are over (jobs, health probes)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- request log ---------------------------------------------------------------------------

    def record(self, rpc: str, request: Message, context: Context) -> None:
        metadata = context.invocation_metadata() or ()
        headers = {key: value for key, value in metadata if isinstance(value, str)}
        payload = MessageToDict(request, preserving_proto_field_name=True)
        self.state.record(GRPC_METHOD, f"/{self.service}/{rpc}", headers, payload)

    # -- generation ----------------------------------------------------------------------------

    def run(self, job: Job, context: Context) -> Run:
        """Start the job on the engine; the end of the call, however it ends, leaves it."""
        started = Run(self.state, job, self._tasks)
        context.add_done_callback(lambda _: started.leave())
        return started

    async def before_generation(self, context: Context) -> None:
        """Queue while loading, then fail as the backend does when it is dead or a generation
        status is injected (before the request is looked at, as on the HTTP side)."""
        await self.state.wait_loaded()
        faults = self.state.faults
        if faults.dead:
            await self.on_dead(context)
        if faults.generation_status is not None:
            await self.on_generation_status(context, faults.generation_status)

    async def on_dead(self, context: Context) -> None:
        await context.abort(grpc.StatusCode.INTERNAL, self.http.dead_message)

    async def on_generation_status(self, context: Context, status: int) -> None:
        await context.abort(grpc_code_for_http_status(status), self.state.faults.generation_error)

    async def check_rank(self, context: Context, pinned: int | None) -> int:
        """The rank the job runs on: ``pinned`` (INVALID_ARGUMENT, the HTTP side's message, out
        of range) or the next one round-robin."""
        size = self.state.dp_size
        if pinned is not None and not 0 <= pinned < size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, self.http.rank_out_of_range(pinned, size)
            )
        return self.state.route(pinned)

    async def stopping(self, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)

    def garbled(self, response: Any) -> Message | None:
        """A final ``complete`` response as the garbage fault leaves it: None when it is not
        sent at all (the stream then ends OK without it)."""
        garbage = self.state.faults.garbage
        if garbage in ("empty", "truncated"):
            return None
        if garbage == "no_finish_reason":
            response.complete.finish_reason = ""
        elif garbage == "wrong_token_count":
            response.complete.completion_tokens += 1
        return response  # type: ignore[no-any-return]

    async def engine_health(self) -> bool:
        """Whether the engine says it is healthy, as grpchealth.py's grpc.health.v1 says it: not
        while loading, dead or with health_status at 300 or above (a hung engine is healthy);
        health_latency delays the answer."""
        faults = self.state.faults
        if faults.health_latency:
            await asyncio.sleep(faults.health_latency)
        forced = faults.health_status
        return not (self.state.loading or faults.dead or (forced is not None and forced >= 300))


async def first_done(*waits: Awaitable[Any], seconds: float) -> None:
    """Wait until the first of ``waits`` is done or ``seconds`` pass; cancel the others."""
    futures = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(futures, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            future.cancel()
