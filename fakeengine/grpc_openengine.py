"""OpenEngine's gRPC services, faked (``--grpc-port N --grpc-service openengine``):
``openengine.v1.Inference`` (Generate) and ``openengine.v1.Control`` (Health, GetLoad, Abort,
GetModelInfo, GetServerInfo) as TensorRT-LLM's merged OpenEngine adapter serves them
(``tensorrt_llm/grpc/openengine/``: servicer.py, control.py, disagg.py; read, not run), on schema
v0.1.0 (``sidecar/transports/openengine/messages.py`` names the revision), for any backend of
vllm, sglang and trtllm, on the same :class:`EngineState` as the HTTP side (faults, counters,
request log, jobs).

The messages are the sidecar's own declarations (``DECLARED``) extended with what a server needs
beyond the client's subset (``kv`` and its session, ``AbortRequest.all_requests`` and
``kv_session``, a few ServerInfo and ModelInfo fields: :data:`SERVER`), registered in a
descriptor pool of the fake's own (:data:`POOL`), never the default one, where the sidecar's
declarations live when both run in one process. The wire is the same: the tests speak to this
server with the sidecar's classes.

Modelled:

- Generate: ``request_id`` and ``model`` non-empty (any model name is served), exactly one of
  ``prompt``/``token_ids``, a duplicate ``request_id`` in flight ALREADY_EXISTS, ``lora_name``
  and ``kv.bypass_prefix_cache`` UNIMPLEMENTED; those are statuses. ``stopping.max_tokens`` is
  the length; unset it is 16 (the fake's default: the real one has no limit but max_seq_len).
  Streamed: one ``token`` per generated token (a delta: output_index 0, ``[TokenInfo{token_id}]``
  and its text, none with ``extra.detokenize`` false), then ``finished`` {0, LENGTH} with
  ``usage``; status OK.
- Roles, per request as the adapter's disagg.py maps them: ``kv.session`` is the generation-only
  leg (the session must carry an endpoint with a port or an ``opaque_state``, and an integer
  ``session_id``), ``extra.request_type`` ``context_only`` or ``context_and_generation`` (else
  INVALID_ARGUMENT; ``generation_only`` there too). ``context_and_generation`` runs locally like
  an aggregated request. ``context_only`` computes the context phase (one token, its ``token``
  event sent: whether the real engine fills one there is not verified), then ends with
  ``prefill_ready`` {kv_session} and usage, no ``finished``, and pins the session in the state
  (``pinned_kv_sessions`` in /_fake/state) until a ``kv.session`` leg takes it, or the process
  exits. The fake's own rules: a ``kv.session`` it did not pin is INVALID_ARGUMENT (a real
  generation worker would wait on a context worker that is not there, possibly blocking its
  executor); and in prefill and decode modes a request with neither ``kv.session`` nor
  ``extra.request_type`` is refused, INVALID_ARGUMENT "Disaggregated params are required for
  <mode> mode" (DIS-1737, the HTTP and SMG TensorRT-LLM fakes' rule; the merged adapter itself
  runs such a request locally).
- Faults: ``hang_generation``/``hang_ranks`` hold Generate until released, aborted or the client
  leaves (then the job is aborted, as in grpcengine.py); ``latency``/``prefill_seconds`` slow
  it; ``wrong_answer(s)`` change its tokens. ``dead`` and ``generation_status`` are failures of
  an accepted request: one ``error`` EngineError (dead: INTERNAL with the HTTP side's message;
  generation_status: INVALID_ARGUMENT below 500, else INTERNAL, with ``generation_error``) with
  usage, in an OK stream. Garbage: ``wrong_token_count`` adds one to ``usage.completion_tokens``,
  ``no_finish_reason`` finishes UNSPECIFIED, ``empty``/``truncated`` end the stream OK without
  ``finished``; the other kinds change nothing. Shutdown: an EngineError INTERNAL.
- Abort{request_id}: ABORTED (message the id) while it is in flight, ALREADY_FINISHED otherwise;
  the stream then ends OK with ``finished`` CANCELLED and usage. ``all_requests``: every
  Generate and probe in flight, ABORTED "aborted N request(s)" or ALREADY_FINISHED when none;
  ``kv_session`` UNIMPLEMENTED; no target INVALID_ARGUMENT.
- Health: checks ``grpc`` READY "serving", ``model`` READY (the served model) or NOT_READY
  "engine health check failed" (loading, dead, or ``health_status`` >= 300; ``health_latency``
  delays it), ``kv_connector`` READY "DEFAULT" in prefill and decode modes (a cache transceiver
  is configured there), and with ``include_inference_probe`` the engine's own probe: one
  1-token generation (token id 1), shared by concurrent callers (a new one only after the last
  ended), counted by GetLoad, reachable by Abort(all_requests), with a timeout
  (``EngineConfig.openengine_probe_timeout``, ``--openengine-probe-timeout``, 30 s; while
  loading it queues within it): ``inference_probe`` READY (the request's
  model, else the served one), or DEGRADED "probe did not complete within 30.0s" (then aborted)
  or the failure's message. The state is the first non-READY check's, else READY: never
  STARTING (the real server opens its port once loaded) nor DRAINING (v0.1.0 has none).
  ``role`` is ignored, as the adapter ignores it.
- GetLoad: instance_id, ``timestamp_unix_nanos`` now, ``running_requests`` the Generate streams
  in flight plus a running probe; ``queued_requests`` never set. UNAVAILABLE "KV occupancy
  sample is stale while requests are active" when requests are in flight and the engine made
  no step (generated no token, on any rank) for longer than
  ``EngineConfig.openengine_load_stale_seconds`` (``--openengine-load-stale``, 30 s) since they
  started running: the adapter with load reporting on, a hung generation making no step.
- GetModelInfo: model_id = served_model_name = the model, max_context_length, text and token
  input. GetServerInfo: engine_name ``tensorrt_llm`` (else the backend's name), engine_version
  ``0.0.0+fakeengine``, engine_role UNSPECIFIED (the role is per request), the schema revision.
- Loading: a Generate queues until the model is loaded (the real server, like the fake's vllm
  and trtllm, opens no port while loading; the fake's sglang does). Generate and Abort are
  recorded in the request log (method ``GRPC``, path ``/openengine.v1.<Service>/<Rpc>``); Health,
  GetLoad and the info calls are not.

Not modelled: n > 1, logprobs, stop conditions and stop_match (every answer finishes LENGTH),
media, guided decoding, the stall watchdog (OVERLOADED), the metadata keys (DP-rank targeting,
priority), KV blocks and per-rank load in GetLoad, parallelism, capacity and kv_connector in
ServerInfo; LoRA and KV-event RPCs answer UNIMPLEMENTED (not served). A ``prefill_seconds``
prefill makes no step here (its chunks would refresh the real load sample). A request refused at
submission (the real adapter's INTERNAL status when its executor is already shut down) is not
told apart from a failure after acceptance: ``dead`` is always the EngineError.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message

from fakeengine.backends import BACKENDS
from fakeengine.grpc_base import (
    GRPC_METHOD,
    MAX_CONTEXT_LENGTH,
    STOPPING_MESSAGE,
    Context,
    Run,
    Servicer,
)
from fakeengine.schemas import DEFAULT_MAX_TOKENS
from fakeengine.state import EngineState, EngineStopping, Job, count_text_tokens, detokenize
from sidecar.runtime.protodecl import (
    BOOL,
    MESSAGE,
    OPTIONAL,
    REPEATED,
    STRING,
    UINT32,
    Declared,
    Field,
)
from sidecar.transports.openengine.messages import CONTROL, DECLARED, INFERENCE, PACKAGE

# ------------------------------------------------------------------------------- the messages

STRUCT = ".google.protobuf.Struct"
#: What a server needs beyond the sidecar's subset (v0.1.0's numbers); a field the sidecar
#: declares already (by name) is kept as declared.
SERVER_FIELDS: Final[Mapping[str, tuple[Field, ...]]] = {
    "KvEndpoint": (
        ("host", 1, OPTIONAL, STRING, None),
        ("port", 2, OPTIONAL, UINT32, None),
        ("protocol", 3, OPTIONAL, STRING, None),
    ),
    "KvSessionRef": (
        ("session_id", 1, OPTIONAL, STRING, None),
        ("transfer_backend", 2, OPTIONAL, STRING, None),
        ("endpoints", 3, REPEATED, MESSAGE, "KvEndpoint"),
        ("dp_rank", 4, OPTIONAL, UINT32, None),
        ("attributes_struct", 5, OPTIONAL, MESSAGE, STRUCT),
    ),
    "KvOptions": (
        ("session", 1, OPTIONAL, MESSAGE, "KvSessionRef"),
        ("bypass_prefix_cache", 2, OPTIONAL, BOOL, None),
        ("cache_salt", 3, OPTIONAL, STRING, None),
    ),
    "GenerateRequest": (
        ("kv", 8, OPTIONAL, MESSAGE, "KvOptions"),
        ("lora_name", 11, OPTIONAL, STRING, None),
    ),
    "AllRequests": (),
    "AbortRequest": (
        ("kv_session", 2, OPTIONAL, MESSAGE, "KvSessionRef"),
        ("all_requests", 3, OPTIONAL, MESSAGE, "AllRequests"),
    ),
    "ModelInfo": (
        ("max_context_length", 4, OPTIONAL, UINT32, None),
        ("supports_text_input", 20, OPTIONAL, BOOL, None),
        ("supports_token_ids_input", 21, OPTIONAL, BOOL, None),
        ("supports_lora", 23, OPTIONAL, BOOL, None),
        ("supports_multimodal", 24, OPTIONAL, BOOL, None),
    ),
    "ServerInfo": (
        ("instance_id", 4, OPTIONAL, STRING, None),
        ("supported_models", 5, REPEATED, STRING, None),
        ("schema_revision", 8, OPTIONAL, UINT32, None),
        ("minimum_client_revision", 9, OPTIONAL, UINT32, None),
        ("schema_release", 10, OPTIONAL, STRING, None),
    ),
}
SERVER_ONEOFS: Final = {"AbortRequest": {"target": ("kv_session", "all_requests")}}
#: v0.1.0's manifest (TensorRT-LLM's proto/manifest.json).
SCHEMA_REVISION, MINIMUM_CLIENT_REVISION = 1, 1
SCHEMA_RELEASE = "768a93c7b44e40f28c692ad0b471a8f2"


def extended(
    declared: Declared,
    fields: Mapping[str, tuple[Field, ...]],
    oneofs: Mapping[str, Mapping[str, tuple[str, ...]]],
    file: str,
) -> Declared:
    """``declared`` with more fields and oneof members (those it lacks, by name), as a file of
    its own name."""
    messages = dict(declared.messages)
    for name, more in fields.items():
        have = messages.get(name, ())
        names = {field[0] for field in have}
        messages[name] = (*have, *(field for field in more if field[0] not in names))
    groups = {name: dict(members) for name, members in declared.oneofs.items()}
    for name, more_groups in oneofs.items():
        mine = groups.setdefault(name, {})
        for group, members in more_groups.items():
            have_members = mine.get(group, ())
            mine[group] = (*have_members, *(m for m in members if m not in have_members))
    return dataclasses.replace(declared, file=file, messages=messages, oneofs=groups)


SERVER = extended(DECLARED, SERVER_FIELDS, SERVER_ONEOFS, "fakeengine/openengine_v1_server.proto")
#: The fake's own pool: never the default one, where the sidecar registers its subset.
POOL = descriptor_pool.DescriptorPool()
SERVER.register(POOL)
MESSAGES: Final = {name: SERVER.message(name, POOL) for name in SERVER.messages}
Struct = message_factory.GetMessageClass(POOL.FindMessageTypeByName("google.protobuf.Struct"))
GenerateResponse, TokenOutput = MESSAGES["GenerateResponse"], MESSAGES["TokenOutput"]
TokenInfo, Usage, EngineError = MESSAGES["TokenInfo"], MESSAGES["Usage"], MESSAGES["EngineError"]
GenerationFinished, PrefillReady = MESSAGES["GenerationFinished"], MESSAGES["PrefillReady"]
KvSessionRef, HealthCheck = MESSAGES["KvSessionRef"], MESSAGES["HealthCheck"]


def enum_value(enum: str, name: str) -> int:
    return POOL.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_name[name].number  # type: ignore[no-any-return]


UNSPECIFIED = enum_value("FinishReason", "FINISH_REASON_UNSPECIFIED")
LENGTH = enum_value("FinishReason", "FINISH_REASON_LENGTH")
CANCELLED = enum_value("FinishReason", "FINISH_REASON_CANCELLED")
INVALID = enum_value("ErrorCode", "ERROR_CODE_INVALID_ARGUMENT")
INTERNAL = enum_value("ErrorCode", "ERROR_CODE_INTERNAL")
READY = enum_value("HealthState", "HEALTH_STATE_READY")
DEGRADED = enum_value("HealthState", "HEALTH_STATE_DEGRADED")
NOT_READY = enum_value("HealthState", "HEALTH_STATE_NOT_READY")
ABORTED = enum_value("AbortStatus", "ABORT_STATUS_ABORTED")
ALREADY_FINISHED = enum_value("AbortStatus", "ABORT_STATUS_ALREADY_FINISHED")
ROLE_UNSPECIFIED = enum_value("EngineRole", "ENGINE_ROLE_UNSPECIFIED")

# ------------------------------------------------------------------------------- the servicer

#: The ids the adapter gives its Health probes (counted in GetLoad, reached by all_requests).
PROBE_PREFIX = "__openengine_health_probe__"
#: The cache transceiver's backend a disaggregated worker reports (TensorRT-LLM's default).
KV_TRANSFER_BACKEND = "DEFAULT"
STALE_MESSAGE = "KV occupancy sample is stale while requests are active"
ENGINE_NAMES = {"trtllm": "tensorrt_llm"}
CONTEXT_ONLY, BOTH, GENERATION_ONLY = "context_only", "context_and_generation", "generation_only"
EXTRA_REQUEST_TYPES = (BOTH, CONTEXT_ONLY)


class Refusal(Exception):
    """A request refused before it is accepted: the call's status and its message."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


class _Services(grpc.GenericRpcHandler):
    """The two services' generic handlers as one (the first that knows the method)."""

    def __init__(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._handlers = tuple(handlers)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for handler in self._handlers:
            found = handler.service(details)
            if found is not None:
                return found
        return None


class OpenEngineServicer(Servicer):
    """Inference and Control over one engine state (the module docstring says what is what)."""

    backend = "openengine"

    def __init__(self, state: EngineState) -> None:  # no smg_grpc_proto: no Servicer.__init__
        self.state = state
        self.http = BACKENDS[state.config.backend](state)
        self.service = f"{INFERENCE},{CONTROL}"
        self.instance_id = f"fakeengine-{uuid.uuid4().hex[:16]}"
        self._tasks: set[asyncio.Future[Any]] = set()
        self._active: dict[str, Job] = {}  # the adapter's in-flight table: streams and probes
        self._busy_since = time.monotonic()  # when the table last became non-empty
        self._probe: asyncio.Future[Message] | None = None

    def handler(self) -> grpc.GenericRpcHandler:
        """Each service's methods, by the method of the same name, their messages and streaming
        as the fake's pool declares them."""
        handlers = []
        for name in (INFERENCE, CONTROL):
            table = {}
            for method in POOL.FindServiceByName(name).methods:
                request = message_factory.GetMessageClass(method.input_type)
                response = message_factory.GetMessageClass(method.output_type)
                make: Callable[..., grpc.RpcMethodHandler] = (
                    grpc.unary_stream_rpc_method_handler
                    if method.server_streaming
                    else grpc.unary_unary_rpc_method_handler
                )
                table[method.name] = make(
                    getattr(self, method.name),
                    request_deserializer=request.FromString,
                    response_serializer=response.SerializeToString,
                )
            handlers.append(grpc.method_handlers_generic_handler(name, table))
        return _Services(handlers)

    def _record(self, service: str, rpc: str, request: Message, context: Context) -> None:
        metadata = context.invocation_metadata() or ()
        headers = {key: value for key, value in metadata if isinstance(value, str)}
        payload = MessageToDict(request, preserving_proto_field_name=True)
        self.state.record(GRPC_METHOD, f"/{service}/{rpc}", headers, payload)

    def _track(self, job: Job) -> None:
        if not self._active:
            self._busy_since = time.monotonic()
        self._active[job.request_id] = job

    def _untrack(self, job: Job) -> None:
        if self._active.get(job.request_id) is job:
            del self._active[job.request_id]

    def _failure(self) -> tuple[int, str] | None:
        """How an accepted request fails now (an EngineError's code and message), or None."""
        faults = self.state.faults
        if faults.dead:
            return INTERNAL, self.http.dead_message
        status = faults.generation_status
        if status is not None:
            return (INVALID if status < 500 else INTERNAL), faults.generation_error
        return None

    # -- Inference/Generate --------------------------------------------------------------------

    async def Generate(self, request: Any, context: Context) -> AsyncIterator[Message]:
        self._record(INFERENCE, "Generate", request, context)
        await self.state.wait_loaded()
        try:
            job, phase, detokenized = self._admit(request)
        except Refusal as refused:
            await context.abort(refused.code, str(refused))
            return
        self._track(job)
        try:
            failure = self._failure()
            if failure is not None:
                yield self._error(job, *failure, completion=0)
                return
            if phase == GENERATION_ONLY:  # the decode leg takes its KV: the session is freed
                self.state.pinned_kv_sessions.discard(request.kv.session.session_id)
            run = self.run(job, context)
            try:
                async for token in run.stream():
                    text = detokenize([token]) if detokenized else ""
                    delta = [TokenInfo(token_id=token)]
                    output = TokenOutput(output_index=0, tokens=delta, text=text)
                    yield GenerateResponse(request_id=job.request_id, token=output)
            except EngineStopping:
                yield self._error(job, INTERNAL, STOPPING_MESSAGE, completion=len(run.tokens))
                return
            if job.finish_reason == "abort":
                yield self._finished(job, CANCELLED, len(run.tokens))
            elif phase == CONTEXT_ONLY:
                yield self._prefill_ready(job, run.tokens)
            else:
                final = self._garbled(job, len(run.tokens))
                if final is not None:
                    yield final
        finally:
            self._untrack(job)

    def _admit(self, request: Any) -> tuple[Job, str | None, bool]:
        """The job a request asks for, its phase (None: aggregated) and whether its tokens are
        detokenized; raises a Refusal for what the adapter refuses, in its order."""
        if not request.request_id:
            raise Refusal("request_id must be non-empty")
        if not request.model:
            raise Refusal("model must be non-empty")
        if request.request_id in self._active:
            raise Refusal(
                f"request_id '{request.request_id}' is already active",
                grpc.StatusCode.ALREADY_EXISTS,
            )
        unsupported = grpc.StatusCode.UNIMPLEMENTED
        if request.lora_name:
            raise Refusal("LoRA selection is not supported", unsupported)
        if request.kv.bypass_prefix_cache:
            raise Refusal("prefix cache bypass is not supported", unsupported)
        kind = request.WhichOneof("input")
        if kind is None:
            raise Refusal("exactly one of prompt or token_ids must be set")
        prompt_ids: list[int] | None = None
        if kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
            prompt_tokens = len(prompt_ids)
        else:
            prompt_tokens = count_text_tokens(request.prompt) if request.prompt.strip() else 0
        if prompt_tokens == 0:
            raise Refusal("the prompt must not be empty")  # the fake's wording: the engine's check
        stopping = request.stopping
        max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            raise Refusal("max_tokens must be at least 1")  # the fake's wording
        extra = MessageToDict(request.extra) if request.HasField("extra") else {}
        detokenized = extra.get("detokenize", True)
        if not isinstance(detokenized, bool):
            raise Refusal("extra.detokenize must be a bool")
        phase = self._phase(request, extra)
        mode = self.state.config.mode
        if phase is None and mode in ("prefill", "decode"):
            raise Refusal(f"Disaggregated params are required for {mode} mode")
        job = Job(
            request_id=request.request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=1 if phase == CONTEXT_ONLY else max_tokens,  # the context phase: 1 token
            prompt_ids=prompt_ids,
            stream=True,
        )
        job.rank = self.state.route(None)
        return job, phase, detokenized

    def _phase(self, request: Any, extra: Mapping[str, Any]) -> str | None:
        """disagg.py's phase: ``kv.session`` generation-only, else ``extra.request_type``."""
        if request.kv.HasField("session"):
            self._check_session(request.kv.session)
            return GENERATION_ONLY
        request_type = extra.get("request_type")
        if request_type is None:
            return None
        if request_type == GENERATION_ONLY:
            raise Refusal(
                "a generation_only request must carry its context handoff in kv.session; "
                "extra.request_type alone cannot address one"
            )
        if request_type not in EXTRA_REQUEST_TYPES:
            raise Refusal(f"extra.request_type must be one of {sorted(EXTRA_REQUEST_TYPES)}")
        return str(request_type)

    def _check_session(self, session: Any) -> None:
        """disagg.py's checks of a session, then the fake's: it must be one pinned here."""
        attrs = (
            MessageToDict(session.attributes_struct)
            if session.HasField("attributes_struct")
            else {}
        )
        endpoint = attrs.get("ctx_info_endpoint")
        if not endpoint and session.endpoints and session.endpoints[0].host:
            first = session.endpoints[0]
            endpoint = f"{first.host}:{first.port}" if first.port else first.host
        if endpoint:
            address = str(endpoint)
            try:
                port = urlsplit(address if "://" in address else f"//{address}").port
            except ValueError:
                port = None
            if not port:
                raise Refusal(f"kv.session ctx_info_endpoint '{endpoint}' is not a usable address")
        elif not attrs.get("opaque_state"):
            raise Refusal("kv.session carries neither a ctx_info_endpoint nor an opaque_state")
        if not session.session_id and attrs.get("disagg_request_id") is None:
            raise Refusal("kv.session carries neither a session_id nor a disagg_request_id")
        if session.session_id:
            try:
                int(session.session_id)
            except ValueError:
                raise Refusal(
                    "kv.session.session_id must be an integer context request id"
                ) from None
        if session.session_id not in self.state.pinned_kv_sessions:
            raise Refusal(
                f"kv.session '{session.session_id}' is no KV session this engine pinned (the "
                "fake refuses it: a real generation worker would wait on its context worker)"
            )

    def _usage(self, job: Job, completion: int) -> Message:
        return Usage(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=completion,
            total_tokens=job.prompt_tokens + completion,
        )

    def _error(self, job: Job, code: int, message: str, *, completion: int) -> Message:
        error = EngineError(code=code, message=message, retryable=False)
        usage = self._usage(job, completion)
        return GenerateResponse(request_id=job.request_id, error=error, usage=usage)

    def _finished(
        self, job: Job, reason: int, completion: int, reported: int | None = None
    ) -> Message:
        finished = GenerationFinished(output_index=0, reason=reason)
        usage = self._usage(job, completion if reported is None else reported)
        return GenerateResponse(request_id=job.request_id, finished=finished, usage=usage)

    def _garbled(self, job: Job, completion: int) -> Message | None:
        """The final ``finished`` as the garbage fault leaves it (None: not sent)."""
        garbage = self.state.faults.garbage
        if garbage in ("empty", "truncated"):
            return None
        reason = UNSPECIFIED if garbage == "no_finish_reason" else LENGTH
        return self._finished(
            job, reason, completion, completion + (garbage == "wrong_token_count")
        )

    def _prefill_ready(self, job: Job, tokens: list[int]) -> Message:
        """The context phase's handoff (disagg.py's ``prefill_ready_response``), its session
        pinned until a decode leg takes it."""
        session_id = str(uuid.uuid4().int >> 65)  # ctx_request_id: an integer
        opaque = base64.b64encode(f"fakeengine-kv:{job.request_id}".encode()).decode()
        attributes = ParseDict({"opaque_state": opaque, "first_gen_tokens": tokens[:1]}, Struct())
        session = KvSessionRef(
            session_id=session_id,
            transfer_backend=KV_TRANSFER_BACKEND,
            dp_rank=0,
            attributes_struct=attributes,
        )
        self.state.pinned_kv_sessions.add(session_id)
        ready = PrefillReady(kv_session=session)
        usage = self._usage(job, len(tokens))
        return GenerateResponse(request_id=job.request_id, prefill_ready=ready, usage=usage)

    # -- Control -------------------------------------------------------------------------------

    async def Abort(self, request: Any, context: Context) -> Message:
        self._record(CONTROL, "Abort", request, context)
        response = MESSAGES["AbortResponse"]
        target = request.WhichOneof("target")
        if target == "request_id":
            job = self._active.get(request.request_id)
            if job is not None:
                job.abort.set()
            status = ABORTED if job is not None else ALREADY_FINISHED
            return response(status=status, message=request.request_id)
        if target == "all_requests":
            jobs = list(self._active.values())
            for job in jobs:
                job.abort.set()
            status = ABORTED if jobs else ALREADY_FINISHED
            return response(status=status, message=f"aborted {len(jobs)} request(s)")
        if target == "kv_session":
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "aborting by kv_session is not supported; abort by request_id",
            )
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "AbortRequest has no target set")

    async def Health(self, request: Any, context: Context) -> Message:
        model = self.state.config.model
        checks = [HealthCheck(name="grpc", state=READY, message="serving")]
        if await self.engine_health():
            checks.append(HealthCheck(name="model", state=READY, message=model))
        else:
            failed = "engine health check failed"
            checks.append(HealthCheck(name="model", state=NOT_READY, message=failed))
        if self.state.config.mode in ("prefill", "decode"):
            checks.append(
                HealthCheck(name="kv_connector", state=READY, message=KV_TRANSFER_BACKEND)
            )
        if request.include_inference_probe:
            checks.append(await self._inference_probe(request.model or model))
        state = next((check.state for check in checks if check.state != READY), READY)
        return MESSAGES["HealthResponse"](state=state, checks=checks)

    async def _inference_probe(self, model: str) -> Message:
        """One probe shared by concurrent callers; a caller that leaves does not cancel it."""
        probe = self._probe
        if probe is None or probe.done():
            probe = asyncio.ensure_future(self._run_probe(model))
            self._tasks.add(probe)
            probe.add_done_callback(self._tasks.discard)
            self._probe = probe
        return await asyncio.shield(probe)

    async def _run_probe(self, model: str) -> Message:
        timeout = float(self.state.config.openengine_probe_timeout)
        name = "inference_probe"
        failure = self._failure()
        if failure is not None:  # generate_async raises: the error's text
            return HealthCheck(name=name, state=DEGRADED, message=failure[1])
        job = Job(request_id=f"{PROBE_PREFIX}{time.time_ns()}", prompt_tokens=1, max_tokens=1)
        job.prompt_ids = [1]
        run: Run | None = None
        try:
            async with asyncio.timeout(timeout):
                await self.state.wait_loaded()  # queued, as a Generate is, within its timeout
                job.rank = self.state.route(None)
                self._track(job)
                run = Run(self.state, job, self._tasks)
                await _drain(run)
        except TimeoutError:
            message = f"probe did not complete within {timeout}s"
            return HealthCheck(name=name, state=DEGRADED, message=message)
        except EngineStopping:
            return HealthCheck(name=name, state=DEGRADED, message=STOPPING_MESSAGE)
        finally:
            if run is not None:
                run.leave()  # a probe that did not finish (timed out, cancelled) is aborted
            self._untrack(job)
        return HealthCheck(name=name, state=READY, message=model)  # aborted too: it finished

    async def GetLoad(self, request: Any, context: Context) -> Message:
        running = len(self._active)
        sampled = max(self.state.last_output_at, self._busy_since)
        stale = self.state.config.openengine_load_stale_seconds
        if running and time.monotonic() - sampled > stale:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STALE_MESSAGE)
        return MESSAGES["LoadInfo"](
            instance_id=self.instance_id,
            timestamp_unix_nanos=time.time_ns(),
            running_requests=running,
        )

    async def GetModelInfo(self, request: Any, context: Context) -> Message:
        model = self.state.config.model
        return MESSAGES["ModelInfo"](
            model_id=model,
            served_model_name=model,
            max_context_length=MAX_CONTEXT_LENGTH,
            supports_text_input=True,
            supports_token_ids_input=True,
            supports_lora=False,
            supports_multimodal=False,
        )

    async def GetServerInfo(self, request: Any, context: Context) -> Message:
        backend = self.state.config.backend
        return MESSAGES["ServerInfo"](
            engine_name=ENGINE_NAMES.get(backend, backend),
            engine_version="0.0.0+fakeengine",
            engine_role=ROLE_UNSPECIFIED,
            instance_id=self.instance_id,
            supported_models=[self.state.config.model],
            schema_revision=SCHEMA_REVISION,
            minimum_client_revision=MINIMUM_CLIENT_REVISION,
            schema_release=SCHEMA_RELEASE,
        )


async def _drain(run: Run) -> None:
    async for _ in run.stream():
        pass
