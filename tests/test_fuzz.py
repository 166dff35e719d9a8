"""Every parser of untrusted input, fuzzed (issue 35, item 3): what the engine answers (its JSON
bodies, its streams and gRPC messages, its Prometheus text, its sleep, model, fault and discovery
routes) and the environment (the variables, an ``--env-file``). Each input ends in what a user
sees: an outcome with a reason, a ConfigError line naming the variable, a value or None; never
an exception, a hang, or a read past the byte bound.

Inputs are drawn near each parser's own shapes (the fields its prober reads, the series its spec
names, a message of its proto) and then broken: junk in any field, bytes of any kind, bodies of a
few MB, compressed bodies that inflate past the bound, endless bodies. The engine client runs on
httpx's MockTransport, each call under ``asyncio.wait_for``: nothing here opens a socket.

A property that finds a defect in ``sidecar/`` is marked ``xfail(strict=True)`` with its
smallest failing example first (``@example``) until the fix takes the mark off. Eight were found
this way and fixed; the comment above each such test says what it found (its first example is
the counterexample).

Coverage-guided fuzzing (atheris) of the metrics, the JSON judgement and the gRPC messages:
``scripts/fuzz_atheris.py``, by hand, outside the suite.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gzip
import json
import math
import os
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from dotenv import dotenv_values
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from sidecar import wiring
from sidecar.config import ConfigError, Settings
from sidecar.core.evidence.faults import EngineReport, read_status, report_for
from sidecar.core.evidence.lifecycle import sleeping_in
from sidecar.core.evidence.load import LoadSample, read_load
from sidecar.core.evidence.progress import (
    MAX_LINE_CHARS,
    Exposition,
    MetricsUnreadable,
    ProgressSample,
    Series,
    matching,
    ranks_in,
    read_progress,
)
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import TransferSample, read_transfers
from sidecar.core.vocabulary import Mode
from sidecar.probes.base import CanaryPlan, CanaryRequest
from sidecar.probes.exchange import (
    ERROR_TEXT_CHARS,
    Answer,
    Checked,
    NoAnswer,
    Received,
    Streamed,
    error_text,
    parsed_answer,
)
from sidecar.probes.judge import judge
from sidecar.runtime.engine import EngineClient
from sidecar.runtime.grpcchannel import GrpcEngine, UnreadableMessage, _as_dict
from sidecar.runtime.grpctarget import GrpcTarget
from sidecar.transports import TRANSPORTS
from sidecar.transports.dynamo.identity import (
    IDENTITY_SERIES,
    Instance,
    instances_in_metadata,
    instances_in_metrics,
    pick,
)
from sidecar.transports.dynamo.worker import DynamoWorker
from sidecar.transports.grpc import service_names
from sidecar.transports.grpc.base import GrpcProber
from sidecar.transports.grpc.sglang_native_pb import DECLARED as SGLANG_NATIVE
from sidecar.transports.openengine import control
from sidecar.transports.openengine.messages import DECLARED as OPENENGINE
from tests.support.configured import blueprint_of

pytestmark = pytest.mark.unit

T = TypeVar("T")

COMMON = {
    "deadline": None,
    "database": None,  # nothing written into the work tree
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
}


#: Runs every property for this many times its inputs (by hand, for a longer search).
SCALE = int(os.environ.get("HEALTH_SIDECAR_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> Any:
    """A property run for ``examples`` inputs (sized so that the file runs in seconds; times
    HEALTH_SIDECAR_FUZZ_SCALE); a failure is shrunk, not explained (tracing each line is slow)."""
    phases = [Phase.explicit, Phase.generate, Phase.shrink]
    return settings(max_examples=examples * SCALE, phases=phases, **COMMON)


#: A property that found a defect: its explicit examples first (the smallest that fails), then
#: generated ones once it is fixed; nothing shrunk (the example is already the smallest).
KNOWN = settings(
    max_examples=25,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,  # the first failure as raised (xfail's ``raises``)
    **COMMON,
)

#: Seconds any one call may take before it counts as a hang (every call here is in memory).
HANG = 10.0
MB = 1024 * 1024


def run(call: Callable[[], Awaitable[T]]) -> T:
    """One async call on a fresh loop, under a deadline: a hang fails the example."""

    async def bounded() -> T:
        return await asyncio.wait_for(call(), HANG)

    return asyncio.run(bounded())


# --- the plans: every transport, backend and role that gets a canary ------------------------------


def engine_url(transport: Any) -> str:
    """An engine URL of the kind the transport takes (its seam says grpc:// or http(s)://)."""
    return "grpc://127.0.0.1:50051" if transport.grpc_url else "http://127.0.0.1:8000"


PAYLOAD = '{"prompt": "x", "max_tokens": 1}'  # a user's DYN_HEALTH_CHECK_PAYLOAD: generic checks


def _all_plans() -> dict[str, CanaryPlan]:
    plans: dict[str, CanaryPlan] = {}
    for name, transport in TRANSPORTS.items():
        for backend in transport.backends:
            services = service_names(backend) if name == "grpc" else (None,)
            for mode in Mode:
                for service in services:
                    for payload in (None, PAYLOAD):
                        fields: dict[str, object] = {
                            "backend": backend,
                            "disaggregation_mode": mode.value,
                            "transport": name,
                            "engine_url": engine_url(transport),
                            "health_check_enabled": True,
                        }
                        if mode is Mode.ENCODE:
                            fields["model_type"] = "multimodal"
                            if name == "dynamo":
                                fields["embedding_transfer_mode"] = "local"
                        if service is not None:
                            fields["grpc_service"] = service
                        if payload is not None:
                            fields["health_check_payload"] = payload
                        plan = blueprint_of(**fields).plan
                        if not plan.enabled:
                            continue
                        key = "-".join(
                            [name, backend, mode.value]
                            + ([service.rsplit(".", 1)[-1]] if service else [])
                            + (["payload"] if payload else [])
                        )
                        plans[key] = plan
    return plans


PLANS = _all_plans()
HTTP_PLANS = {k: p for k, p in PLANS.items() if p.prober.transport == "http"}
STREAM_PLANS = {k: p for k, p in PLANS.items() if p.prober.transport == "dynamo"}
GRPC_PLANS = {k: p for k, p in PLANS.items() if p.prober.transport in ("grpc", "openengine")}
# Each unit's plan, a rank's too (its series scoped to the rank's label).
UNIT_PLANS = {
    **PLANS,
    **{f"{k}-rank1": p.for_rank(1) for k, p in PLANS.items() if p.reads.pin is not None},
}


def _plan_id(item: tuple[str, CanaryPlan]) -> str:
    return item[0]


def plans_of(plans: dict[str, CanaryPlan]) -> st.SearchStrategy[tuple[str, CanaryPlan]]:
    return st.sampled_from(sorted(plans.items(), key=_plan_id))


def request_of(plan: CanaryPlan) -> CanaryRequest:
    return plan.request("model", "canary-fuzz")


def received(answer: Answer | Streamed | NoAnswer) -> Received:
    return Received(answer, 0.0, 0.01, 0.0)


def assert_verdict(result: Result) -> None:
    """What a user sees of a canary: an outcome, and a reason in words."""
    assert isinstance(result, Result)
    assert isinstance(result.outcome, Outcome)
    assert isinstance(result.reason, str)
    assert result.reason.strip(), result
    assert "Traceback" not in result.reason
    assert result.answer is None or isinstance(result.answer, str)


def assert_one_short_line(text: str) -> None:
    """A reason as the log and /health show it: one line, not the engine's whole answer."""
    assert len(text.splitlines()) <= 1, f"{len(text.splitlines())} lines: {text[:200]!r}"
    assert len(text) <= 1024, f"{len(text)} characters: {text[:200]!r}..."


def judged(plan: CanaryPlan, answer: Answer | Streamed) -> Result:
    """The canary's judgement, and what its sweep reads of the answer, as the probe does both."""
    request = request_of(plan)
    result = judge(plan, request, received(answer))
    assert_verdict(result)
    names = plan.leftovers(request, parsed_answer(answer))
    assert isinstance(names, tuple)
    for name in names:  # removed under the storage path: never outside it
        assert isinstance(name, str), names
        assert name, names
        assert not name.startswith("/"), names
        assert ".." not in Path(name).parts, names
    return result


# --- JSON as engines write it, then broken ----------------------------------------------------

#: Words the probers compare with (finish reasons, JSON finish reasons as SGLang's native
#: service sends them), and some that break them.
WORDS = st.sampled_from([
    "length", "stop", "abort", "error", "", "null", "FINISH_REASON_LENGTH", '{"type": "length"}',
    '{"type": "stop", "matched": 2}', '{"type": "abort"}', "[", "x\ny",
])  # fmt: skip
#: The fields the probers and the engine's routes read.
KEYS = st.sampled_from([
    "choices", "text", "token_ids", "finish_reason", "usage", "completion_tokens", "error",
    "message", "detail", "meta_info", "type", "ec_transfer_params", "item_indices",
    "completion_usage", "multimodal_inputs", "embeddings_shape", "serialized_request", "data",
    "id", "is_sleeping", "engines", "status", "endpoints",
]) | st.text(max_size=6)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-2, 5)
    | st.integers()
    | st.floats()
    | WORDS
    | st.text(max_size=12)
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=16,
)
COUNTS = st.integers(0, 4) | st.integers() | JUNK
FINISH = WORDS | JUNK


def obj(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with any of these fields (each right or junk), and junk fields besides."""
    return st.builds(
        lambda known, extra: {**extra, **known},
        st.fixed_dictionaries({}, optional=fields),
        st.dictionaries(KEYS, JUNK, max_size=2),
    )


def right_or_junk(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right kind of value (so that the deeper checks are reached), else junk."""
    return st.one_of(strategy, strategy, JUNK)


#: An error field: mostly absent or empty (as in a good answer), else anything.
ERROR = st.one_of(st.none(), st.just({}), st.just(""), JUNK)


TOKEN_IDS = right_or_junk(st.lists(st.integers(0, 5) | JUNK, max_size=4))
COMPLETION = obj(
    choices=right_or_junk(
        st.lists(
            obj(
                text=right_or_junk(st.text(max_size=8)),
                finish_reason=FINISH,
                token_ids=TOKEN_IDS,
            ),
            max_size=2,
        )
    ),
    usage=right_or_junk(obj(completion_tokens=COUNTS)),
    error=ERROR,
)
SGLANG_ANSWER = obj(
    text=right_or_junk(st.text(max_size=8)),
    meta_info=right_or_junk(
        obj(finish_reason=right_or_junk(obj(type=FINISH)), completion_tokens=COUNTS)
    ),
    error=ERROR,
)
ENCODER_ANSWER = obj(
    ec_transfer_params=right_or_junk(
        st.dictionaries(
            st.text(max_size=8) | st.just("../../etc"),
            right_or_junk(obj(item_indices=right_or_junk(st.just([0])))),
            max_size=2,
        )
    ),
    error=ERROR,
)
HTTP_JSON = COMPLETION | SGLANG_ANSWER | ENCODER_ANSWER | JUNK

CHUNK = obj(
    token_ids=TOKEN_IDS,
    finish_reason=FINISH,
    completion_usage=right_or_junk(obj(completion_tokens=COUNTS)),
    error=ERROR,
)
ENCODED = obj(
    multimodal_inputs=right_or_junk(
        st.lists(
            obj(
                embeddings_shape=right_or_junk(st.lists(st.integers(-1, 4), max_size=3)),
                serialized_request=right_or_junk(
                    obj(
                        serialized_request=right_or_junk(
                            st.sampled_from(
                                [
                                    "/tmp/encoder_cache.ab12_3.xYz_9.safetensors",
                                    "/tmp/../etc/passwd",
                                    "encoder_cache.zz_1.a.safetensors",
                                ]
                            )
                            | st.text(max_size=12)
                        )
                    )
                ),
            ),
            max_size=2,
        )
    ),
)
# A Dynamo worker's chunks: objects, or (its encode worker) the request back as JSON text.
STREAM_CHUNK = st.one_of(CHUNK, CHUNK, CHUNK, ENCODED, ENCODED.map(json.dumps), JUNK)

# A big field: the body grows to a few MB (the judgement itself has no bound: the client's).
PADDING = st.sampled_from([0, 0, 0, 10, 300_000, 3 * MB])


def padded(value: Any, size: int) -> Any:
    if size and isinstance(value, dict):
        return {**value, "pad": "x" * size}
    return value


def body_bytes(value: Any, style: str) -> bytes:
    """A JSON value as an engine may put it on the wire (NaN and Infinity as Python writes
    them): plain, indented, in UTF-16, cut short, or after a byte-order mark."""
    text = json.dumps(value, indent=2 if style == "indented" else None)
    if style == "utf16":
        return text.encode("utf-16")
    if style == "cut":
        return text.encode()[: max(1, len(text) // 2)]
    if style == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    return text.encode()


STYLES = st.sampled_from(["plain", "plain", "indented", "utf16", "cut", "bom"])
RAW_BODIES = st.binary(max_size=300) | st.text(max_size=100).map(str.encode)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/html", ""]
) | st.text(max_size=20)
# A header value as httpx carries it: ASCII.
WIRE_CONTENT_TYPES = st.sampled_from(["application/json", "text/plain; version=0.0.4", ""]) | (
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
)
STATUSES = st.sampled_from([200, 200, 200, 204, 301, 307, 400, 404, 408, 429, 500, 503]) | (
    st.integers(100, 599)
)


# --- the HTTP transport's JSON judgement -------------------------------------------------------


@fuzz(300)
@given(
    plans_of(HTTP_PLANS),
    STATUSES,
    CONTENT_TYPES,
    HTTP_JSON,
    STYLES,
    RAW_BODIES,
    st.booleans(),
    PADDING,
)
def test_an_http_answer_is_judged_with_an_outcome_and_a_reason(
    item: tuple[str, CanaryPlan],
    status: int,
    content_type: str,
    value: Any,
    style: str,
    raw: bytes,
    as_json: bool,
    pad: int,
) -> None:
    """Whatever an engine answers over HTTP, the canary ends with an outcome and a reason; one
    that passes is a 200 JSON object the prober found nothing wrong with."""
    _, plan = item
    body = body_bytes(padded(value, pad), style) if as_json else raw
    answer = Answer(status, content_type, body)
    result = judged(plan, answer)
    if 300 <= status < 400:
        assert result.outcome is Outcome.ERROR
        assert "redirect" in result.reason
    elif status != 200:
        assert result.outcome is Outcome.ERROR
        assert result.reason.startswith(f"HTTP {status}: ")
        assert_one_short_line(result.reason)
    elif not plan.prober.reads_body:
        assert result.outcome is Outcome.SUCCESS
    elif "json" not in content_type.lower():
        assert result.outcome is Outcome.INVALID
        assert "expected JSON" in result.reason
    if result.outcome is Outcome.SUCCESS and plan.prober.reads_body:
        assert isinstance(json.loads(body), dict)


@fuzz(200)
@given(st.binary(max_size=400) | HTTP_JSON.map(lambda v: json.dumps(v).encode()))
def test_the_engines_error_text_is_one_short_line(body: bytes) -> None:
    """An error answer's body, as the reason shows it: the engine's message, or the start of
    its text, on one line, cut at ERROR_TEXT_CHARS."""
    text = error_text(body)
    assert isinstance(text, str)
    assert text
    assert len(text.splitlines()) == 1
    assert len(text) <= ERROR_TEXT_CHARS + 3


@fuzz(150)
@given(
    st.sampled_from([200, 200, 404, 500]),
    st.binary(max_size=200) | HTTP_JSON.map(lambda v: json.dumps(v).encode()),
    st.lists(STREAM_CHUNK, max_size=3),
    st.none() | st.text(max_size=10),
)
def test_parsed_answer_is_the_json_the_chunks_or_none(
    status: int, body: bytes, chunks: list[Any], error: str | None
) -> None:
    parsed = parsed_answer(Answer(status, "application/json", body))
    if status != 200:
        assert parsed is None
    streamed = parsed_answer(Streamed(tuple(chunks), error))
    assert streamed == (None if error is not None else chunks)
    assert parsed_answer(NoAnswer(Outcome.TIMEOUT, "no answer")) is None


# --- Dynamo's streams ---------------------------------------------------------------------------


@fuzz(250)
@given(
    plans_of(STREAM_PLANS),
    st.lists(STREAM_CHUNK, max_size=5),
    st.none() | st.text(max_size=30),
)
def test_a_dynamo_stream_is_judged_with_an_outcome_and_a_reason(
    item: tuple[str, CanaryPlan], chunks: list[Any], error: str | None
) -> None:
    """Whatever a worker streams (any JSON per chunk, or an error event at the end), the canary
    ends with an outcome and a reason; a stream that ended on an error event is an error."""
    _, plan = item
    result = judged(plan, Streamed(tuple(chunks), error))
    if error is not None:
        assert result.outcome is Outcome.ERROR
        assert result.rejection
    if not chunks and error is None:
        assert result.outcome is Outcome.INVALID


# --- gRPC messages: bytes, decoded by the declared messages, mapped as the channel maps them ----

FD = FieldDescriptor


def _json_float(value: float) -> float | str:
    """A float as protobuf's JSON mapping takes it (NaN and the infinities quoted)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FD.TYPE_BOOL:
        return st.booleans()
    if kind == FD.TYPE_STRING:
        return WORDS | st.text(max_size=16)
    if kind == FD.TYPE_BYTES:
        return st.binary(max_size=8).map(lambda b: base64.b64encode(b).decode())
    if kind == FD.TYPE_DOUBLE:
        return st.floats().map(_json_float)
    if kind == FD.TYPE_FLOAT:
        return st.floats(width=32).map(_json_float)
    if kind == FD.TYPE_ENUM:
        return st.sampled_from([v.name for v in field.enum_type.values])
    if kind in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, 4) | st.integers(0, 2**32 - 1)
    if kind in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.integers(0, 4) | st.integers(0, 2**64 - 1)
    if kind in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    return st.integers(-(2**31), 2**31 - 1)  # int32, sint32, sfixed32


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        keys = _scalar(key)
        if key.type == FD.TYPE_STRING:  # SGLang's meta_info: the keys it reads, and any
            keys = st.sampled_from(["finish_reason", "id", "prompt_tokens"]) | keys
        values = _field(value, depth + 1)
        return None if values is None else st.dictionaries(keys, values, max_size=3)
    if message is not None:
        one = message_dicts(message, depth + 1) if depth < 3 else None
    else:
        one = _scalar(field)
    if one is None:
        return None
    return st.lists(one, max_size=4) if field.is_repeated else one


def _one_per_oneof(descriptor: Descriptor, value: dict[str, Any]) -> dict[str, Any]:
    for oneof in descriptor.oneofs:
        present = [f.name for f in oneof.fields if f.name in value]
        for name in present[1:]:
            del value[name]
    return value


@functools.cache
def message_dicts(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """A message of this type as a dict of its fields (any subset, any values), one per oneof."""
    fields = {f.name: s for f in descriptor.fields if (s := _field(f, depth)) is not None}
    return st.fixed_dictionaries({}, optional=fields).map(
        lambda value: _one_per_oneof(descriptor, value)
    )


def response_class(path: str) -> type[Message]:
    method = descriptor_pool.Default().FindMethodByName(path.removeprefix("/").replace("/", "."))
    return message_factory.GetMessageClass(method.output_type)


def _grpc_responses() -> dict[str, type[Message]]:
    OPENENGINE.register()
    SGLANG_NATIVE.register()
    for plan in GRPC_PLANS.values():
        if isinstance(plan.prober, GrpcProber):
            type(plan.prober).messages()  # the engines' stubs: registered on import
    return {key: response_class(plan.path) for key, plan in GRPC_PLANS.items()}


RESPONSES = _grpc_responses()


@st.composite
def wire_bytes(draw: st.DrawFn, kind: type[Message]) -> bytes:
    """What a server may send as one message: a well-formed one, then perhaps damaged, or bytes
    of any kind."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200))
    value = draw(message_dicts(kind.DESCRIPTOR))
    data = bytearray(json_format.ParseDict(value, kind()).SerializeToString())
    for at, replacement in draw(
        st.lists(st.tuples(st.integers(0, max(0, len(data))), st.binary(max_size=3)), max_size=2)
    ):
        data[at : at + len(replacement)] = replacement
    return bytes(data)


def decoded(kind: type[Message], data: bytes) -> dict[str, Any] | None:
    """A message as the channel hands it to the probe (``reply.FromString``, then ``_as_dict``,
    as ``sidecar/runtime/grpcchannel.py`` does); None: it does not decode, and gRPC ends the
    call with a status, which is not the probe's to judge."""
    try:
        message = kind.FromString(data)
        as_dict = _as_dict(message)
    except (DecodeError, UnreadableMessage):  # the channel answers INVALID (tested below)
        return None
    assert isinstance(as_dict, dict)
    return as_dict


def map_key_not_utf8(exc: Exception) -> bool:
    """The known defect of ``_as_dict`` (test_a_grpc_map_key_that_is_no_utf8_...): a map key of
    a message the sidecar declares in proto2 (no UTF-8 check on the wire) that is not UTF-8."""
    return "meta_info" in str(exc) and "codec can't decode" in str(exc)


@st.composite
def grpc_exchange(draw: st.DrawFn) -> tuple[str, CanaryPlan, list[bytes]]:
    key, plan = draw(plans_of(GRPC_PLANS))
    return key, plan, draw(st.lists(wire_bytes(RESPONSES[key]), max_size=4))


@fuzz(250)
@given(grpc_exchange())
def test_a_grpc_call_is_judged_with_an_outcome_and_a_reason(
    exchange: tuple[str, CanaryPlan, list[bytes]],
) -> None:
    """Whatever messages a gRPC server sends (each decoded by the declared message, well formed,
    damaged or of any bytes), the canary ends with an outcome and a reason."""
    key, plan, wire = exchange
    try:
        maybe = [decoded(RESPONSES[key], data) for data in wire]
    except json_format.SerializeToJsonError as exc:
        if not map_key_not_utf8(exc):
            raise
        return  # known, and asserted there
    messages = tuple(m for m in maybe if m is not None)
    result = judged(plan, Streamed(messages))
    if not messages:
        assert result.outcome is Outcome.INVALID


# --- OpenEngine's Control service: the registration check, the engine's probe, its load ---------

CONTROL_METHODS = {
    path: response_class(path)
    for path in (control.HEALTH, control.GET_MODEL_INFO, control.GET_LOAD)
}


class Scripted:
    """A gRPC channel that answers each method with what the example drew."""

    def __init__(self, answers: dict[str, Streamed | NoAnswer]) -> None:
        self.answers = answers

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        return received(self.answers[request.path])

    def redact(self, text: str) -> str:
        return text


@st.composite
def control_answers(draw: st.DrawFn) -> dict[str, Streamed | NoAnswer]:
    answers: dict[str, Streamed | NoAnswer] = {}
    for path, kind in CONTROL_METHODS.items():
        if draw(st.integers(0, 5)) == 0:
            status = draw(st.sampled_from(["UNAVAILABLE", "INTERNAL", None]))
            said = draw(st.sampled_from(["load sample is stale", "no", ""]))
            answers[path] = NoAnswer(Outcome.ERROR, f"{path} -> {status}: {said}", status=status)
        else:
            message = decoded(kind, draw(wire_bytes(kind)))
            answers[path] = Streamed(() if message is None else (message,))
    return answers


OPENENGINE_PLAN = next(p for k, p in PLANS.items() if k.startswith("openengine-trtllm-agg"))


@fuzz(100)
@given(control_answers(), st.sampled_from(list(control.ROLES)))
def test_openengine_control_answers_end_in_a_check_and_a_load_sample(
    answers: dict[str, Streamed | NoAnswer], role: Mode
) -> None:
    """Whatever the Control service answers (Health, its own inference probe, GetModelInfo,
    GetLoad), the registration check gives an outcome and a reason, the model is a name or
    None, and the load is an exposition the load source reads."""
    channel = Scripted(answers)

    async def main() -> tuple[Checked, Checked, tuple[str | None, str]]:
        health = control.OpenEngineHealth(
            channel, role=role, timeout=1.0, probe_every=0.0, clock=time.monotonic
        )
        try:
            first = await health()
            await asyncio.sleep(0)  # its own inference probe, started by the first, ends
            second = await health()
        finally:
            await health.aclose()
        load = await control.OpenEngineLoad(channel, timeout=1.0).metrics_text(control.GET_LOAD)
        return first, second, load

    first, second, (text, why) = run(main)
    for checked in (first, second):
        assert_verdict(checked.registration)
        if checked.model is not None:
            model, said = checked.model
            assert model is None or (isinstance(model, str) and model)
            assert isinstance(said, str)
        opinion = checked.engine_health
        assert opinion is None or isinstance(opinion.detail, str)
    assert isinstance(why, str)
    if text is not None:
        spec = OPENENGINE_PLAN.reads.load
        assert spec is not None
        sample = read_load(Exposition.parse(text, {s.name for s in spec.every()}), spec, 0.0)
        assert isinstance(sample, LoadSample)


# --- the engine client: status, headers, encodings, the byte bound ------------------------------

URL = "http://engine:8000"
# Compressed answers that inflate far past any bound (a zip bomb is a few KB on the wire).
BOMBS = {
    "gzip": gzip.compress(bytes(8 * MB)),
    "deflate": zlib.compress(bytes(8 * MB)),
}


class Endless(httpx.AsyncByteStream):
    """A body that never ends: the client must stop reading at its bound."""

    def __init__(self, chunk: bytes) -> None:
        self.chunk = chunk
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += len(self.chunk)
            yield self.chunk

    async def aclose(self) -> None:
        """Nothing to close."""


ENCODINGS = st.sampled_from(["", "identity", "gzip", "x-gzip", "deflate", " GZIP ", "br", "zstd"])


@st.composite
def wire_answers(draw: st.DrawFn) -> dict[str, Any]:
    """An HTTP answer as the engine's socket carries it: status, headers, body bytes (as JSON
    the routes read, any bytes, a few MB, a bomb), and how it is encoded."""
    encoding = draw(ENCODINGS)
    kind = draw(st.sampled_from(["json", "raw", "large", "bomb", "endless", "bad-encoding"]))
    plain = b""
    if kind == "json":
        plain = json.dumps(
            draw(
                obj(
                    is_sleeping=right_or_junk(st.booleans()),
                    data=right_or_junk(st.lists(obj(id=right_or_junk(st.text(max_size=8))))),
                    error=ERROR,
                    detail=JUNK,
                    message=JUNK,
                )
                | JUNK
            )
        ).encode()
    elif kind == "raw":
        plain = draw(st.binary(max_size=300))
    elif kind == "large":
        plain = b"x" * draw(st.integers(1000, 4 * MB))
    coding = encoding.strip().lower()
    if kind == "bomb":
        coding = draw(st.sampled_from(["gzip", "deflate"]))
        encoding, wire = coding, BOMBS[coding]
    elif kind == "bad-encoding":
        encoding, wire = draw(st.sampled_from(["gzip", "deflate"])), draw(st.binary(max_size=50))
    elif coding in ("gzip", "x-gzip"):
        wire = gzip.compress(plain, compresslevel=1)
    elif coding == "deflate":
        wire = zlib.compress(plain, 1)
    else:
        wire = plain
    headers = {"content-type": draw(WIRE_CONTENT_TYPES)}
    if encoding:
        headers["content-encoding"] = encoding
    if kind != "endless" and draw(st.booleans()):
        headers["content-length"] = str(len(wire))
    return {
        "status": draw(STATUSES),
        "headers": headers,
        "wire": wire,
        "plain": plain,
        "kind": kind,
        "max_bytes": draw(st.sampled_from([1024, 4096, 65536, MB])),
    }


def client_of(answer: dict[str, Any]) -> tuple[EngineClient, list[Endless]]:
    endless: list[Endless] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if answer["kind"] == "endless":
            stream: httpx.AsyncByteStream = Endless(b"x" * 65536)
            endless.append(stream)  # type: ignore[arg-type]
        else:
            stream = httpx.ByteStream(answer["wire"])
        return httpx.Response(answer["status"], headers=answer["headers"], stream=stream)

    client = EngineClient(
        URL, timeout=5.0, max_bytes=answer["max_bytes"], transport=httpx.MockTransport(handler)
    )
    return client, endless


def over_the_bound(answer: dict[str, Any]) -> bool:
    """The answer, as it arrives or once decompressed, holds more than the client may read."""
    limit = answer["max_bytes"]
    if answer["kind"] in ("bomb", "endless"):
        return True
    coding = answer["headers"].get("content-encoding", "").strip().lower()
    if len(answer["wire"]) > limit:
        return True
    return coding in ("gzip", "x-gzip", "deflate") and len(answer["plain"]) > limit


@fuzz(200)
@given(
    wire_answers(), st.sampled_from(["send", "get", "registration", "metrics", "sleep", "model"])
)
def test_the_engine_client_ends_every_answer_within_its_bound(
    answer: dict[str, Any], call: str
) -> None:
    """Whatever the engine's HTTP answer (any status, any encoding, a few MB, a body that never
    ends, a compressed body that inflates past the bound), every call of the engine client comes
    back with an answer, an outcome or a reason; one over SIDECAR_MAX_RESPONSE_BYTES is INVALID
    'answer too large' after reading at most the bound (and one chunk)."""
    client, endless = client_of(answer)
    limit = answer["max_bytes"]

    async def main() -> Any:
        try:
            if call == "send":
                request = CanaryRequest("POST", "/v1/completions", {"a": 1}, "canary-1", 1)
                return await client.send(request, 5.0)
            if call == "get":
                return await client.get("/fault_tolerance/status")
            if call == "registration":
                return await client.registration("/health", any_status=answer["status"] < 300)
            if call == "metrics":
                return await client.metrics_text("/metrics")
            if call == "sleep":
                return await client.sleep_state("/is_sleeping")
            return await client.served_model()
        finally:
            await client.aclose()

    got = run(main)
    for stream in endless:
        assert stream.sent <= limit + len(stream.chunk), "read past the bound"
    too_large = over_the_bound(answer)
    coding = answer["headers"].get("content-encoding", "").strip().lower()
    unsupported = coding in ("br", "zstd")
    # Bytes of any kind said to be compressed: they may inflate to something, or not at all.
    garbled = answer["kind"] == "bad-encoding"
    if call == "send":
        assert isinstance(got, Received)
        if too_large:
            assert isinstance(got.answer, NoAnswer), got
            assert got.answer.outcome is Outcome.INVALID
            assert got.answer.reason.startswith("answer too large ("), got.answer.reason
        elif isinstance(got.answer, Answer):
            assert not unsupported
            assert len(got.answer.body) <= limit
            assert garbled or got.answer.body == answer["plain"]
        else:
            assert unsupported or garbled, got.answer
            assert got.answer.outcome is Outcome.INVALID, got.answer
    elif call == "get":
        assert isinstance(got, Answer | NoAnswer)
        if too_large:
            assert isinstance(got, NoAnswer)
            assert "answer too large" in got.reason
    elif call == "registration":
        assert_verdict(got)
        assert got.reason.startswith("GET /health")
        assert_one_short_line(got.reason)
        if too_large:
            assert got.outcome is Outcome.INVALID
            assert "answer too large" in got.reason
    elif call == "metrics":
        text, why = got
        assert text is None or (isinstance(text, str) and len(text.encode()) <= 3 * limit)
        assert why.startswith("GET /metrics")
        if too_large:
            assert text is None
            assert "answer too large" in why
    elif call == "sleep":
        sleeping, why, missing = got
        assert sleeping in (True, False, None)
        assert why.startswith("GET /is_sleeping")
        if missing:
            assert answer["status"] == 404
        if not (unsupported or garbled):
            assert missing is (answer["status"] == 404 and not too_large)
    else:
        model, why = got
        assert model is None or (isinstance(model, str) and model)
        assert why.startswith("GET /v1/models")
        assert_one_short_line(why)


@fuzz(20)
@given(st.sampled_from(["gzip", "deflate"]), st.sampled_from([1024, 65536, MB]))
def test_a_compressed_bomb_is_answer_too_large(encoding: str, limit: int) -> None:
    """A few KB on the wire that inflate to 8 MB: INVALID, 'answer too large', nothing kept."""
    answer = {
        "status": 200,
        "headers": {"content-type": "application/json", "content-encoding": encoding},
        "wire": BOMBS[encoding],
        "plain": b"",
        "kind": "bomb",
        "max_bytes": limit,
    }
    client, _ = client_of(answer)

    async def main() -> Received:
        try:
            return await client.send(CanaryRequest("GET", "/x", {}, "c", None), 5.0)
        finally:
            await client.aclose()

    got = run(main).answer
    assert isinstance(got, NoAnswer)
    assert got.outcome is Outcome.INVALID
    # Over the bound on the wire already, or once decompressed.
    assert got.reason.startswith(f"answer too large (more than {limit} bytes"), got.reason
    if len(BOMBS[encoding]) <= limit:
        assert got.reason.endswith(" once decompressed)"), got.reason


# --- Prometheus and OpenMetrics text ------------------------------------------------------------


def _every_series(plan: CanaryPlan) -> tuple[Series, ...]:
    transfers = plan.transfers.every() if plan.transfers is not None else ()
    load = plan.reads.load.every() if plan.reads.load is not None else ()
    return (*plan.progress_spec().every(), *transfers, *plan.awake, *load)


SERIES_NAMES = sorted(
    {s.name for plan in UNIT_PLANS.values() for s in _every_series(plan)}
    | {s.name for s in IDENTITY_SERIES}
)
LABEL_NAMES = sorted(
    {k for plan in UNIT_PLANS.values() for s in _every_series(plan) for k, _ in s.labels}
    | {"engine", "dp_rank", "worker_id", "model_name", "le", "quantile"}
    | {"dynamo_namespace", "dynamo_component", "dynamo_endpoint"}
)
LABEL_VALUES = sorted(
    {v for plan in UNIT_PLANS.values() for s in _every_series(plan) for _, v in s.labels}
    | {"0", "1", "2", "3", "-1", "a1", "ff", "7fffffff", "0x1f", "dynamo", "backend", "generate"}
)


def _name_forms(name: str) -> list[str]:
    base = name.removesuffix("_total").removesuffix("_count")
    return [name, base, f"{base}_total", f"{base}_count", f"{base}_created", name.replace(":", "_")]


NAMES = st.sampled_from(SERIES_NAMES).flatmap(lambda n: st.sampled_from(_name_forms(n)))
VALUE_TEXT = st.sampled_from(LABEL_VALUES) | st.text(max_size=10)


def _label(name: str, value: str, escaped: bool) -> str:
    if escaped:
        value = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{name}="{value}"'


LABELS = st.lists(
    st.builds(
        _label, st.sampled_from(LABEL_NAMES) | st.text(max_size=6), VALUE_TEXT, st.booleans()
    ),
    max_size=5,
).map(lambda labels: "{" + ",".join(labels) + "}" if labels else "")
NUMBERS = (
    st.floats().map(repr)
    | st.integers().map(str)
    | st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "-0", "0x10", "1_000", ""])
    | st.text(max_size=6)
)
SAMPLE_LINE = st.builds(
    lambda name, labels, value, stamp: f"{name}{labels} {value}{stamp}",
    NAMES,
    LABELS,
    NUMBERS,
    st.sampled_from(["", " 1700000000000", " 1.5", " x"]),
)
META_LINE = st.builds(
    lambda kind, name, rest: f"# {kind} {name} {rest}".rstrip(),
    st.sampled_from(["TYPE", "HELP", "UNIT", "EOF"]),
    NAMES,
    st.sampled_from(["gauge", "counter", "histogram", "summary", "untyped", "info", ""])
    | st.text(max_size=10),
)
LINES = st.lists(
    SAMPLE_LINE | SAMPLE_LINE | META_LINE | st.just("# EOF") | st.text(max_size=40), max_size=12
)
NEWLINES = st.sampled_from(["\n", "\n", "\r\n", "\n\n"])


def _repeated(lines: list[str], newline: str, size: int) -> str:
    block = newline.join(lines) + newline
    return block * max(1, size // len(block))


ONE_COPY = st.just(0)


def expositions(size: st.SearchStrategy[int] = ONE_COPY) -> st.SearchStrategy[str]:
    """Prometheus or OpenMetrics text of the series the plans read, and noise; with a size, its
    lines repeated to about that many characters (an engine with thousands of series)."""
    return st.builds(_repeated, LINES, NEWLINES, size)


def rank_labels_crash(parsed: Exposition, gauges: tuple[Series, ...], label: str) -> bool:
    """The known defect of ranks_in (test_a_rank_label_that_is_no_ascii_number_...): a label
    value str.isdigit() takes for a number that int() refuses."""
    values = [sample.labels.get(label, "") for _, sample in matching(parsed, gauges)]
    return any(v.isdigit() and not (v.isascii() and len(v) <= 4300) for v in values)


def assert_reads(text: str, plan: CanaryPlan) -> None:
    """Every reader of one metrics read, as the monitor fans it out: a sample, or unreadable."""
    spec = plan.progress_spec()
    try:
        parsed = Exposition.parse(text, {s.name for s in _every_series(plan)})
    except MetricsUnreadable as exc:
        unreadable = str(exc)
    else:
        unreadable = None
    if unreadable is not None:
        assert unreadable.startswith("not a Prometheus exposition: "), unreadable
        return
    sample = read_progress(parsed, spec, 1.0, 2.0, (1, 1))
    assert isinstance(sample, ProgressSample)
    assert sample.in_flight is None or isinstance(sample.in_flight, float)
    assert all(isinstance(v, float) for v in sample.counters.values())
    assert set(sample.found) <= {str(s) for s in spec.every()}
    if plan.transfers is not None:
        transfers = read_transfers(parsed, plan.transfers, 1.0, 2.0)
        assert transfers is None or isinstance(transfers, TransferSample)
    if plan.awake:
        sleeping, what = sleeping_in(parsed, plan.awake)
        assert sleeping in (True, False, None)
        assert isinstance(what, str)
    if plan.reads.load is not None:
        assert isinstance(read_load(parsed, plan.reads.load, 1.0), LoadSample)
    if plan.reads.pin is not None:
        gauges, label = (*spec.running, *spec.waiting), plan.reads.pin.label
        try:
            ranks = ranks_in(parsed, gauges, label)
        except ValueError:
            assert rank_labels_crash(parsed, gauges, label)
        else:
            assert ranks == tuple(sorted(ranks))
            assert all(isinstance(r, int) and r >= 0 for r in ranks)


@fuzz(400)
@given(plans_of(UNIT_PLANS), expositions())
def test_every_reader_of_the_engines_metrics_ends_in_a_sample_or_unreadable(
    item: tuple[str, CanaryPlan], text: str
) -> None:
    """Whatever an engine serves at its metrics route, each reader (progress, a rank's progress,
    transfers, the sleep gauge, the load, the rank count) gives its sample, or the read is
    'not a Prometheus exposition'."""
    assert_reads(text, item[1])


@fuzz(8)
@given(plans_of(PLANS), expositions(st.integers(MB, 3 * MB)))
def test_a_few_mb_of_metrics_are_read_whole(item: tuple[str, CanaryPlan], text: str) -> None:
    """Metrics of a few MB (an engine with thousands of series) parse, in seconds at most."""
    started = time.monotonic()
    assert_reads(text, item[1])
    assert time.monotonic() - started < HANG


WANTS = st.sampled_from(["generate", "dynamo.backend.generate", "backend.generate", "x"])


@fuzz(150)
@given(expositions(), WANTS)
def test_the_worker_instance_in_its_metrics_is_one_none_or_several(text: str, want: str) -> None:
    """A Dynamo worker's metrics name its instance, none yet, or several (then a reason that
    says which variable picks one); a worker_id that is no hex id is unreadable."""
    try:
        found = instances_in_metrics(text, want)
    except MetricsUnreadable as exc:
        unreadable = str(exc)
    else:
        unreadable = None
    if unreadable is not None:
        assert "worker_id" in unreadable or unreadable.startswith("not a Prometheus exposition")
        return
    assert found == sorted(set(found))
    instance, why = pick(found, want, "GET /metrics")
    assert (instance is not None) == (len(found) == 1)
    assert why.startswith(f"{instance} (GET /metrics)" if instance else "GET /metrics names")


RECORD = obj(
    type=right_or_junk(st.just("Endpoint")),
    namespace=right_or_junk(st.sampled_from(["dynamo", ""])),
    component=right_or_junk(st.sampled_from(["backend", ""])),
    endpoint=right_or_junk(st.sampled_from(["generate", "clear_kv_blocks"])),
    instance_id=right_or_junk(st.integers(-1, 2**64)),
    transport=right_or_junk(obj(tcp=right_or_junk(st.just("127.0.0.1:1234")))),
)
METADATA = obj(endpoints=right_or_junk(st.dictionaries(st.text(max_size=12), RECORD, max_size=3)))


@fuzz(150)
@given(METADATA | JUNK, WANTS)
def test_the_worker_instance_in_its_metadata_is_found_or_refused(document: Any, want: str) -> None:
    """A worker's /metadata (Kubernetes discovery) names its instances, or is refused with a
    reason (ValueError, which the registration check turns into its reason)."""
    try:
        found = instances_in_metadata(document, want)
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = None
    if refused is not None:
        assert refused.strip()
        return
    assert all(isinstance(i, Instance) and i.instance_id >= 0 for i in found)
    instance, why = pick(found, want, "GET /metadata")
    assert (instance is not None) == (len(found) == 1)
    assert isinstance(why, str)


ENGINE_ENTRY = obj(
    id=right_or_junk(st.integers(0, 3)),
    status=right_or_junk(st.sampled_from(["healthy", "unhealthy", "dead", "paused", "Healthy"])),
    fault_info=JUNK,
    ft_error=JUNK,
)
FAULT_STATUS = obj(engines=right_or_junk(st.lists(ENGINE_ENTRY, max_size=4)))


@fuzz(150)
@given(
    st.sampled_from([200, 200, 404, 500]),
    (FAULT_STATUS | JUNK).map(json.dumps) | st.text(max_size=60),
    st.none() | st.integers(0, 3),
)
def test_a_fault_tolerance_status_gives_reports_or_nothing(
    status: int, body: str, rank: int | None
) -> None:
    """vLLM's /fault_tolerance/status: each engine's report by its rank, nothing usable, or
    (404) no fault tolerance at all."""
    reports, missing = read_status(status, body)
    assert missing is (status == 404)
    if reports is None:
        return
    assert all(isinstance(r, int) and isinstance(v, EngineReport) for r, v in reports.items())
    engine, report = report_for(reports, rank)
    assert report is None or report.state == report.state.lower()
    assert engine is None or isinstance(engine, int)


# --- a Dynamo worker's system server: the registration check ------------------------------------


class Plane:
    """The request plane, as the registration check asks it (no runtime behind it)."""

    def __init__(self, local: bool) -> None:
        self.local = local
        self.where = "Kubernetes (the worker's /metadata)" if local else "etcd"

    async def listed(self, instance: Instance) -> bool:
        return True

    async def advertise(self, instance: Instance) -> bool:
        return True


@fuzz(100)
@given(
    st.booleans(),
    STATUSES,
    expositions(),
    (METADATA | JUNK).map(json.dumps),
    st.sampled_from([200, 503]),
    (obj(status=right_or_junk(st.sampled_from(["ready", "notready"]))) | JUNK).map(json.dumps),
)
def test_a_dynamo_workers_system_server_ends_in_a_check(
    local: bool, status: int, metrics: str, metadata: str, health_status: int, health: str
) -> None:
    """Whatever the worker's system server answers (its metrics or /metadata, its /health), the
    registration check gives an outcome and a reason, and the instance when it found one."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(health_status, stream=httpx.ByteStream(health.encode()))
        body = metadata.encode() if path == "/metadata" else metrics.encode()
        return httpx.Response(status, stream=httpx.ByteStream(body))

    async def main() -> Checked:
        client = EngineClient(
            URL, timeout=5.0, max_bytes=MB, transport=httpx.MockTransport(handler)
        )
        worker = DynamoWorker(
            None,
            client,
            Plane(local),  # type: ignore[arg-type]
            health_path="/health",
            metrics_path="/metrics",
        )
        try:
            return await worker()
        finally:
            await client.aclose()

    checked = run(main)
    assert_verdict(checked.registration)
    if checked.registration.ok:
        assert checked.registration.identity is not None
    assert checked.engine_health is not None
    assert checked.engine_health.detail.startswith("GET /health -> ")


# --- the environment ----------------------------------------------------------------------------

ALIASES = sorted(str(f.validation_alias) for f in Settings.model_fields.values())


def _near_misses(name: str) -> list[str]:
    other = f"SIDECAR_{name[4:]}" if name.startswith("DYN_") else f"DYN_{name[8:]}"
    return [name, name[:-1], f"{name}S", name.lower(), name.replace("_", "", 1), other]


VARIABLE_NAMES = st.sampled_from(ALIASES).flatmap(lambda n: st.sampled_from(_near_misses(n))) | (
    st.builds(
        lambda prefix, rest: prefix + rest,
        st.sampled_from(["SIDECAR_", "DYN_"]),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12),
    )
)
# Anything an environment value can hold: no NUL, no lone surrogate.
ENV_TEXT = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
    min_size=1,
    max_size=40,
)
SPECIAL_VALUES = st.sampled_from([
    "true", "false", "auto", "0", "-1", "1e999", "nan", "1" * 5000, " 1 ",
    "\u00b2", "\u0663", "\uff11",  # digits str.isdigit() takes that int() may not
    "@/nonexistent", "@/dev/null", "@/proc/self/status", "@BIG", "@BINARY",
    '{"a": 1}', '{"a": NaN}', "[" * 5000, '["generate"]', '["kv_transfer"]',
    "grpc://h:1", "grpc://h:1/svc", "grpc://[::1]:0", "http://h", "https://u:p@h/", "http://h?q",
    "vllm", "sglang", "openengine", "dynamo", "grpc", "encode", "multimodal", "local",
    "/health", "/live", "/metrics", "65536", "9090",
])  # fmt: skip
VALUES = ENV_TEXT | SPECIAL_VALUES


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files the variables may name: a payload of a few MB, one that is no text."""
    where = tmp_path_factory.mktemp("fuzz-env")
    big = {"prompt": "x" * (3 * MB), "max_tokens": 1}
    (where / "big.json").write_text(json.dumps(big), encoding="utf-8")
    (where / "binary.json").write_bytes(b"\xff\xfe\x00{")
    return where


def with_files(value: str, scratch: Path) -> str:
    return value.replace("@BIG", f"@{scratch / 'big.json'}").replace(
        "@BINARY", f"@{scratch / 'binary.json'}"
    )


def assert_loaded_or_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], env_file: str | None = None
) -> Settings | None:
    """wiring.load: Settings, or ConfigError whose every line names a variable (or --env-file)
    and says what was expected; never another exception."""
    for key in list(os.environ):
        if key.startswith(("DYN_", "SIDECAR_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    named = {*ALIASES, *env, "--env-file"}
    if env_file is not None:
        named |= set(dotenv_values(env_file))
    try:
        return wiring.load(env_file)
    except ConfigError as exc:
        lines = exc.lines
    assert lines
    for line in lines:
        assert len(line.splitlines()) == 1, line
        assert any(line.startswith((f"{n}=", f"{n}:")) for n in named), line
        assert ": expected " in line, line
    return None


@fuzz(150)
@example(env={"DYN_HEALTH_CHECK_PAYLOAD": "@BIG"})
@example(env={"DYN_HEALTH_CHECK_PAYLOAD": "@BINARY"})
@example(env={"DYN_HEALTH_CHECK_PAYLOAD": "[" * 5000})
@example(env={"SIDECAR_DP_RANKS": "\u00b2", "SIDECAR_MAX_RESPONSE_BYTES": "1" * 5000})
@given(st.dictionaries(VARIABLE_NAMES, VALUES, max_size=6))
def test_any_environment_loads_or_names_each_wrong_variable(
    scratch: Path, env: dict[str, str]
) -> None:
    """Any values of the sidecar's variables and their near misses: the settings, or one line
    per wrong variable, each starting with its name."""
    env = {k: with_files(v, scratch) for k, v in env.items()}
    with pytest.MonkeyPatch.context() as monkeypatch:
        settings_ = assert_loaded_or_named(monkeypatch, env)
    assert settings_ is None or isinstance(settings_, Settings)


def _env_line(name: str, value: str, style: str) -> str:
    if style == "quoted":
        return f'{name}="{value}"'
    if style == "single":
        return f"{name}='{value}'"
    if style == "export":
        return f"export {name}={value}"
    if style == "spaced":
        return f"{name} = {value}"
    if style == "comment":
        return f"{name}={value} # a comment"
    return f"{name}={value}"


ENV_FILE_LINES = st.lists(
    st.builds(
        _env_line,
        VARIABLE_NAMES | st.text(max_size=8),
        VALUES | st.text(max_size=20),
        st.sampled_from(["plain", "quoted", "single", "export", "spaced", "comment"]),
    )
    | st.sampled_from(["", "#", "# a comment", "export", "=", "==x", "\ufeff", '"', "\\"])
    | st.text(max_size=40),
    max_size=8,
)


@fuzz(120)
@given(
    ENV_FILE_LINES,
    st.sampled_from(["\n", "\r\n", "\r"]),
    st.dictionaries(VARIABLE_NAMES, VALUES, max_size=2),
)
def test_any_env_file_loads_or_names_each_wrong_variable(
    scratch: Path, lines: list[str], newline: str, env: dict[str, str]
) -> None:
    """Any text as --env-file (any lines, quoting, comments, exports, NULs), with or without
    variables set beside it: the settings, or each line naming a variable or --env-file."""
    path = scratch / "fuzz.env"
    path.write_text(newline.join(lines), encoding="utf-8")
    env = {k: with_files(v, scratch) for k, v in env.items()}
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert_loaded_or_named(monkeypatch, env, str(path))


def test_a_missing_env_file_is_named(scratch: Path) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert assert_loaded_or_named(monkeypatch, {}, str(scratch / "absent.env")) is None


# --- what the properties found (each a defect in sidecar/, marked until it is fixed) -----------

# JSON nested deeper than the interpreter's recursion limit: json.loads raises RecursionError, not
# the ValueError every reader of the engine's JSON catches. 100,000 levels (100 KB, below the
# default 1 MiB bound) fail on any Python; on 3.11 about 1,000 do (sys.getrecursionlimit()).
DEEP = 100_000


def _deep(opening: str) -> bytes:
    return (opening * DEEP).encode()


def _deep_judged(plan_key: str, answer: Answer | Streamed) -> Result:
    return judge(PLANS[plan_key], request_of(PLANS[plan_key]), received(answer))


def _deep_client(call: str, status: int, body: bytes) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=httpx.ByteStream(body))

    async def main() -> Any:
        client = EngineClient(
            URL, timeout=5.0, max_bytes=MB, transport=httpx.MockTransport(handler)
        )
        try:
            if call == "registration":
                return await client.registration("/health")
            if call == "sleep":
                return await client.sleep_state("/is_sleeping")
            return await client.served_model()
        finally:
            await client.aclose()

    return run(main)


def _deep_worker(local: bool, path: str, body: bytes) -> Checked:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == path:
            return httpx.Response(200, stream=httpx.ByteStream(body))
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"))

    async def main() -> Checked:
        client = EngineClient(
            URL, timeout=5.0, max_bytes=MB, transport=httpx.MockTransport(handler)
        )
        worker = DynamoWorker(
            None,
            client,
            Plane(local),  # type: ignore[arg-type]
            health_path="/health",
            metrics_path="/metrics",
        )
        try:
            return await worker()
        finally:
            await client.aclose()

    return run(main)


NATIVE_KEY = "grpc-sglang-aggregated-SglangService"
ENCODE_KEY = "dynamo-vllm-encode"

# Where deeply nested JSON reaches a json.loads that catches only ValueError, and how it gets
# there: the entry point a monitor's task calls with the engine's bytes.
DEEP_ENTRY_POINTS: dict[str, Callable[[bytes], Any]] = {
    # sidecar/probes/judge.py _http: a 200 JSON canary answer
    "judge-http-200": lambda b: _deep_judged(
        "http-vllm-aggregated", Answer(200, "application/json", b)
    ),
    # sidecar/probes/exchange.py error_text: an error answer's body (via judge, registration)
    "judge-http-500": lambda b: _deep_judged(
        "http-vllm-aggregated", Answer(500, "application/json", b)
    ),
    # sidecar/probes/exchange.py parsed_answer: what the sweep reads of an answer
    "parsed-answer": lambda b: parsed_answer(Answer(200, "application/json", b)),
    # sidecar/transports/dynamo/vllm.py _encoded: the encode worker's chunk, JSON as text
    "judge-dynamo-encode": lambda b: _deep_judged(ENCODE_KEY, Streamed((b.decode(),))),
    # sidecar/transports/grpc/sglang.py _finish_type: meta_info's finish_reason, JSON as text
    "judge-grpc-sglang-native": lambda b: _deep_judged(
        NATIVE_KEY,
        Streamed(
            ({"finished": True, "output_ids": [1, 2], "meta_info": {"finish_reason": b.decode()}},)
        ),
    ),
    # sidecar/runtime/engine.py registration -> error_text: the registration route's error body
    "registration": lambda b: _deep_client("registration", 503, b),
    # sidecar/runtime/engine.py sleep_state: GET /is_sleeping
    "sleep-state": lambda b: _deep_client("sleep", 200, b),
    # sidecar/runtime/engine.py served_model: GET /v1/models
    "served-model": lambda b: _deep_client("model", 200, b),
    # sidecar/core/evidence/faults.py read_status: GET /fault_tolerance/status
    "fault-status": lambda b: read_status(200, b.decode()),
    # sidecar/transports/dynamo/worker.py _engine_health: the worker's GET /health
    "dynamo-worker-health": lambda b: _deep_worker(False, "/health", b),
    # sidecar/transports/dynamo/worker.py _identify: the worker's GET /metadata
    "dynamo-worker-metadata": lambda b: _deep_worker(True, "/metadata", b),
}


# Found by this file, then fixed: JSON nested deeper than the recursion limit raised RecursionError
# out of every reader of the engine's JSON and stopped the monitor; sidecar/core/jsontext.py reads
# it as ValueError.
@pytest.mark.parametrize("entry", sorted(DEEP_ENTRY_POINTS))
@KNOWN
@example(opening="[")
@given(st.sampled_from(["[", '{"a":', '{"error":[', '{"data":[']))
def test_deeply_nested_json_from_the_engine_ends_in_a_verdict(entry: str, opening: str) -> None:
    got = DEEP_ENTRY_POINTS[entry](_deep(opening))
    if isinstance(got, Result):
        assert_verdict(got)


# Found by this file, then fixed: a canary's reason repeated the engine's error text raw (several
# lines, 1 MB); probes/exchange.py engine_said makes it one line of at most 200 characters.
@KNOWN
@example(item=("http-vllm-aggregated", PLANS["http-vllm-aggregated"]), error="a\nb")
@example(item=("http-vllm-aggregated", PLANS["http-vllm-aggregated"]), error="x" * MB)
@given(plans_of(HTTP_PLANS), st.text(min_size=1, max_size=2000))
def test_a_canary_reason_is_one_short_line_whatever_the_engine_says(
    item: tuple[str, CanaryPlan], error: str
) -> None:
    _, plan = item
    body = json.dumps({"error": error}).encode()
    assert_one_short_line(judged(plan, Answer(200, "application/json", body)).reason)
    stream_key = "dynamo-vllm-aggregated"
    chunks = Streamed(({"error": error, "finish_reason": "length"},))
    assert_one_short_line(judged(PLANS[stream_key], chunks).reason)
    assert_one_short_line(judged(PLANS[stream_key], Streamed((), error=error)).reason)


# Found by this file, then fixed: a label value str.isdigit() accepts (a superscript two, 4,301
# digits) raised ValueError out of the rank count and stopped the monitor; ranks_in takes ASCII
# numbers below MAX_DP_RANKS.
@KNOWN
@example(value="\u00b2")
@example(value="1" * 4301)
@given(st.text(min_size=1, max_size=5))
def test_a_rank_label_that_is_no_ascii_number_ends_in_a_count(value: str) -> None:
    text = f'vllm:num_requests_running{{engine="{value}"}} 1\n'
    gauges = (Series("vllm:num_requests_running"),)
    ranks = ranks_in(text, gauges, "engine")
    assert all(isinstance(r, int) for r in ranks)


# Found by this file, then fixed: engine="1" and engine="01" were two ranks, and 2,000 labels 2,000
# units; a rank is now a number below MAX_DP_RANKS (1024), named once.
@KNOWN
@example(values=["1", "01"])
@example(values=[str(i) for i in range(2000)])
@given(st.lists(st.integers(0, 3000).map(str), min_size=1, max_size=50))
def test_the_rank_count_names_each_rank_once_and_at_most_1024(values: list[str]) -> None:
    text = "".join(f'vllm:num_requests_running{{engine="{v}"}} 1\n' for v in values)
    ranks = ranks_in(text, (Series("vllm:num_requests_running"),), "engine")
    assert len(ranks) == len(set(ranks))
    assert len(ranks) <= 1024


METRICS_INTERVAL = Settings.model_fields["metrics_interval"].default
MAX_RESPONSE_BYTES = Settings.model_fields["max_response_bytes"].default


# Found by this file, then fixed: prometheus-client's parser is quadratic in a line's length, and
# one
# 1 MiB line of escaped quotes took 4.1-4.7 s on the monitor's loop; a line of a series read longer
# than MAX_LINE_CHARS now makes the read unreadable at once.
def test_a_metrics_line_longer_than_the_bound_is_unreadable_not_parsed() -> None:
    """One read of the default byte bound as one line of escaped quotes in a label value: read as
    unreadable, naming the bound, before the parser sees it; a line at the bound still parses."""
    head, tail = 'vllm:num_requests_running{engine="', '"} 1\n'
    hostile = head + '\\"' * ((MAX_RESPONSE_BYTES - len(head) - len(tail)) // 2) + tail
    assert len(hostile) <= MAX_RESPONSE_BYTES
    with pytest.raises(MetricsUnreadable, match=f"at most {MAX_LINE_CHARS} are read"):
        Exposition.parse(hostile, {"vllm:num_requests_running"})
    fits = head + "x" * (MAX_LINE_CHARS - len(head) - len(tail) + 1) + tail
    assert len(fits.rstrip("\n")) == MAX_LINE_CHARS
    parsed = Exposition.parse(fits, {"vllm:num_requests_running"})
    assert len(parsed.samples["vllm:num_requests_running"]) == 1


class _OneMessageChannel:
    """A gRPC channel whose every call answers one message, ``wire`` decoded as gRPC decodes it
    (the method's ``response_deserializer``): what a server sent, as the channel receives it."""

    def __init__(self, wire: bytes) -> None:
        self.wire = wire

    def unary_stream(self, path: str, **kinds: Any) -> Callable[..., Any]:
        decode = kinds["response_deserializer"]
        wire = self.wire

        class Call:
            def __aiter__(self) -> AsyncIterator[Message]:
                async def one() -> AsyncIterator[Message]:
                    yield decode(wire)

                return one()

            def cancel(self) -> None:
                pass

        return lambda message, **_: Call()

    def unary_unary(self, path: str, **kinds: Any) -> Callable[..., Awaitable[Message]]:
        decode = kinds["response_deserializer"]

        async def call(message: Message, **_: Any) -> Message:
            return decode(self.wire)

        return call

    async def close(self) -> None:
        pass


@KNOWN
@example(key=b"\x80")
@given(st.binary(min_size=1, max_size=8).filter(lambda b: not _is_utf8(b)))
def test_a_grpc_map_key_that_is_no_utf8_ends_in_a_verdict(key: bytes) -> None:
    """SGLang's native GenerateResponse (declared proto2: no UTF-8 check when decoded) with a
    ``meta_info`` key that is not UTF-8, 5 bytes on the wire (12 03 0a 01 80), decodes; no JSON
    mapping reads it. Found by this file: it raised out of the channel and stopped the monitor.
    Now the channel answers INVALID, one line, as for any unreadable answer."""
    entry = b"\x0a" + bytes([len(key)]) + key  # MetaInfoEntry.key = key
    wire = b"\x12" + bytes([len(entry)]) + entry  # GenerateResponse.meta_info = {key: ""}
    engine = GrpcEngine(GrpcTarget("127.0.0.1", 1, ""), interval=1.0)
    engine._channel = _OneMessageChannel(wire)  # type: ignore[assignment]
    request = request_of(PLANS[NATIVE_KEY])

    async def main() -> Received:
        try:
            return await engine.send(request, 1.0)
        finally:
            await engine.aclose()

    got = run(main).answer
    assert isinstance(got, NoAnswer), got
    assert got.outcome is Outcome.INVALID
    assert "an unreadable message" in got.reason
    assert_one_short_line(got.reason)


# Found by this file, then fixed: a gzip or deflate answer cut short decoded to its prefix, a
# shorter exposition; sidecar/runtime/engine.py _decode now wants the stream's end.
@KNOWN
@example(
    encoding="gzip", body=b"vllm:num_requests_running 0\nvllm:generation_tokens_total 5\n", cut=0.5
)
@given(
    st.sampled_from(["gzip", "deflate"]),
    st.binary(min_size=1, max_size=200),
    st.floats(0.0, 0.99),
)
def test_a_compressed_answer_cut_short_is_no_answer(encoding: str, body: bytes, cut: float) -> None:
    whole = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    wire = whole[: max(1, int(len(whole) * cut))]
    answer = {
        "status": 200,
        "headers": {"content-type": "text/plain", "content-encoding": encoding},
        "wire": wire,
        "plain": b"",
        "kind": "cut",
        "max_bytes": MB,
    }
    client, _ = client_of(answer)

    async def main() -> tuple[str | None, str]:
        try:
            return await client.metrics_text("/metrics")
        finally:
            await client.aclose()

    text, why = run(main)
    assert text is None, f"{len(wire)} of {len(whole)} bytes read as {text!r}"
    assert "decompress" in why


# Found by this file, then fixed: an --env-file that is not UTF-8 raised UnicodeDecodeError from
# python-dotenv (a traceback, exit 1); it is now one --env-file line (exit 2).
@KNOWN
@example(content=b"\xff")
@given(st.binary(min_size=1, max_size=60).filter(lambda b: not _is_utf8(b)))
def test_an_env_file_that_is_not_utf8_is_named(scratch: Path, content: bytes) -> None:
    path = scratch / "binary.env"
    path.write_bytes(content)
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key in list(os.environ):
            if key.startswith(("DYN_", "SIDECAR_")):
                monkeypatch.delenv(key)
        with pytest.raises(ConfigError) as raised:
            wiring.load(str(path))
    assert all(line.startswith("--env-file=") for line in raised.value.lines), raised.value.lines


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
