"""The OpenEngine transport, pure and in-process: its declarations against the reference's field
numbers, the canary per backend and role, the judgement of a whole stream, the registration
check and the load report on a stub channel, and what --check-config says. Against the fake
engine's OpenEngine server as processes: tests/test_openengine_process.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from sidecar.core.evidence.result import Outcome
from sidecar.core.vocabulary import Cause
from sidecar.probes.base import CanaryRequest
from sidecar.probes.exchange import NoAnswer, Received, Streamed
from sidecar.probes.judge import judge
from sidecar.tools.plan import render
from sidecar.transports.openengine import messages
from sidecar.transports.openengine.control import (
    QUEUED,
    RUNNING,
    STALE,
    OpenEngineHealth,
    OpenEngineLoad,
)
from tests.support.configured import blueprint_of

pytestmark = pytest.mark.unit

REFERENCE_PAGE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "openengine.md"

# The field numbers ../shared/reference/openengine.md gives for what the sidecar declares:
# (message, field) -> number, and (enum, value) -> number. Where the schema TensorRT-LLM serves
# (v0.1.0, what is declared) numbers a name otherwise, it is in KNOWN_DIFFERENCES with why.
REFERENCE: dict[tuple[str, str], int] = {
    ("GenerateRequest", "request_id"): 1,
    ("GenerateRequest", "model"): 2,
    ("GenerateRequest", "prompt"): 3,
    ("GenerateRequest", "token_ids"): 4,
    ("GenerateRequest", "sampling"): 5,
    ("GenerateRequest", "stopping"): 6,
    ("GenerateRequest", "extra"): 12,
    ("TokenIds", "ids"): 1,
    ("SamplingParams", "temperature"): 1,
    ("SamplingParams", "top_p"): 2,
    ("SamplingParams", "top_k"): 3,
    ("SamplingParams", "seed"): 8,
    ("StoppingOptions", "max_tokens"): 1,
    ("StoppingOptions", "min_tokens"): 2,
    ("StoppingOptions", "ignore_eos"): 4,
    ("GenerateResponse", "request_id"): 1,
    ("GenerateResponse", "token"): 3,
    ("GenerateResponse", "prefill_ready"): 4,
    ("GenerateResponse", "finished"): 5,
    ("GenerateResponse", "error"): 6,
    ("GenerateResponse", "usage"): 10,
    ("TokenOutput", "output_index"): 1,
    ("TokenOutput", "tokens"): 2,
    ("TokenOutput", "text"): 3,
    ("TokenInfo", "token_id"): 1,
    ("TokenInfo", "token"): 2,
    ("PrefillReady", "kv_session"): 1,
    ("GenerationFinished", "output_index"): 1,
    ("GenerationFinished", "reason"): 2,
    ("GenerationFinished", "message"): 3,
    ("EngineError", "code"): 1,
    ("EngineError", "message"): 2,
    ("EngineError", "retryable"): 3,
    ("Usage", "prompt_tokens"): 1,
    ("Usage", "completion_tokens"): 2,
    ("Usage", "total_tokens"): 3,
    ("KvSessionRef", "session_id"): 1,
    ("HealthRequest", "include_inference_probe"): 1,
    ("HealthRequest", "model"): 2,
    ("HealthRequest", "role"): 3,
    ("HealthResponse", "state"): 1,
    ("HealthResponse", "checks"): 2,
    ("HealthCheck", "name"): 1,
    ("HealthCheck", "state"): 2,
    ("HealthCheck", "message"): 3,
    ("AbortRequest", "request_id"): 1,
    ("AbortResponse", "status"): 1,
    ("AbortResponse", "message"): 2,
    ("GetLoadRequest", "include_per_rank"): 1,
    ("LoadInfo", "instance_id"): 1,
    ("LoadInfo", "timestamp_unix_nanos"): 2,
    ("LoadInfo", "running_requests"): 3,
    ("LoadInfo", "queued_requests"): 4,
}
ENUMS: dict[tuple[str, str], int] = {
    ("FinishReason", "UNSPECIFIED"): 0,
    ("FinishReason", "STOP"): 1,
    ("FinishReason", "LENGTH"): 2,
    ("FinishReason", "CANCELLED"): 3,
    **{
        ("ErrorCode", name): n
        for n, name in enumerate(
            [
                "UNSPECIFIED",
                "INVALID_ARGUMENT",
                "UNSUPPORTED_FEATURE",
                "ROLE_MISMATCH",
                "MODEL_NOT_FOUND",
                "OVERLOADED",
                "REQUEST_NOT_FOUND",
                "DUPLICATE_REQUEST",
                "KV_SESSION_NOT_FOUND",
                "KV_TRANSFER_FAILED",
                "CANCELLED",
                "DRAINING",
                "INTERNAL",
            ]
        )
    },
    ("HealthState", "UNSPECIFIED"): 0,
    ("HealthState", "STARTING"): 1,
    ("HealthState", "READY"): 2,
    ("HealthState", "DEGRADED"): 3,
    ("HealthState", "DRAINING"): 4,
    ("HealthState", "NOT_READY"): 5,
    ("AbortStatus", "UNSPECIFIED"): 0,
    ("AbortStatus", "ABORTED"): 1,
    ("AbortStatus", "ALREADY_FINISHED"): 2,
    ("EngineRole", "UNSPECIFIED"): 0,
    ("EngineRole", "AGGREGATED"): 1,
    ("EngineRole", "PREFILL"): 2,
    ("EngineRole", "DECODE"): 3,
}
# What v0.1.0 (the declarations) numbers otherwise than the reference's newer revision.
KNOWN_DIFFERENCES: dict[tuple[str, str], int | None] = {
    ("ErrorCode", "DRAINING"): None,  # not in v0.1.0
    ("ErrorCode", "INTERNAL"): 11,
    ("HealthState", "DRAINING"): None,  # not in v0.1.0: 4 is NOT_READY there
    ("HealthState", "NOT_READY"): 4,
}


def _declared_enum(enum: str) -> dict[str, int]:
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum).upper() + "_"
    return {name.removeprefix(prefix): n for name, n in messages.DECLARED.enums[enum]}


def test_every_declared_field_number_is_the_references() -> None:
    for (message, field), number in REFERENCE.items():
        assert messages.DECLARED.number(message, field) == number, (message, field)


def test_every_declared_enum_value_is_the_references_or_a_named_difference() -> None:
    for (enum, name), number in ENUMS.items():
        declared = _declared_enum(enum).get(name)
        want = KNOWN_DIFFERENCES.get((enum, name), number)
        assert declared == want, (enum, name, declared, want)
    for (enum, name), number in KNOWN_DIFFERENCES.items():
        assert _declared_enum(enum).get(name) == number


@pytest.mark.skipif(not REFERENCE_PAGE.is_file(), reason="the reference page is not beside this")
def test_the_reference_table_is_what_the_reference_page_says() -> None:
    """The numbers above are the page's own: each field of a message is written "name N" in that
    message's bullet, each enum value "NAME N" in its enum's."""
    page = REFERENCE_PAGE.read_text(encoding="utf-8")

    def bullet(name: str) -> str:
        """From where the page names ``name`` (`Name`: or `Name{`) to the end of that bullet."""
        found = re.search(rf"`{name}(?:`:|\{{).*?(?=\n- |\n\n|$)", page, re.S)
        assert found, name
        return found.group(0)

    for (message, field), number in REFERENCE.items():
        text = bullet(message)
        assert re.search(rf"\b{field} (?:= )?{number}\b", text), (message, field, number)
    for (enum, name), number in ENUMS.items():
        assert re.search(rf"\b{name} {number}\b", bullet(enum)), (enum, name, number)


# --- the canary per backend and role ------------------------------------------------------------
def _plan(backend: str = "trtllm", mode: str = "aggregated", **fields: Any) -> Any:
    return blueprint_of(
        transport="openengine",
        engine_url="grpc://127.0.0.1:50051",
        backend=backend,
        disaggregation_mode=mode,
        health_check_enabled=True,
        **fields,
    )


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_trtllm_prefill_and_decode_run_the_canary_whole_locally(mode: str) -> None:
    """DIS-1737's rule on this contract: extra request_type context_and_generation; never
    context_only (its KV would stay pinned) and never a kv.session."""
    plan = _plan("trtllm", mode).plan
    body = plan.request("tiny", "canary-1").body
    assert plan.enabled, plan.why
    assert body["extra"] == {"request_type": "context_and_generation"}
    assert "kv" not in body
    assert body["stopping"] == {"max_tokens": 2, "ignore_eos": True}
    assert body["model"] == "tiny"
    assert body["request_id"] == "canary-1"
    assert plan.path == "/openengine.v1.Inference/Generate"


def test_an_aggregated_canary_is_a_plain_request() -> None:
    body = _plan("vllm").plan.request(None, "canary-1").body
    assert "extra" not in body
    assert body["token_ids"] == {"ids": [100, 101, 102, 103, 104, 105, 106, 107]}
    assert body["sampling"] == {"temperature": 0.0}
    assert body["model"]  # required non-empty, even before the served model is known


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_sglang_disaggregated_roles_get_no_canary_the_contract_cannot_carry(mode: str) -> None:
    plan = _plan("sglang", mode).plan
    assert not plan.enabled
    assert "no field for SGLang's fake KV transfer" in plan.why


def test_the_abort_of_a_timed_out_canary_is_control_abort_by_its_id() -> None:
    plan = _plan().plan
    abort = plan.prober.abort(plan.request("tiny", "canary-7"))
    assert abort is not None
    assert (abort.path, abort.body) == ("/openengine.v1.Control/Abort", {"request_id": "canary-7"})


# --- the judgement of the whole stream ----------------------------------------------------------
def _token(*ids: int) -> dict[str, Any]:
    return {"token": {"output_index": 0, "tokens": [{"token_id": i} for i in ids]}}


def _finished(reason: str = "FINISH_REASON_LENGTH", completion: int | None = 2) -> dict[str, Any]:
    event: dict[str, Any] = {"finished": {"output_index": 0, "reason": reason}}
    if completion is not None:
        event["usage"] = {"completion_tokens": completion}
    return event


def _judged(*events: dict[str, Any]) -> Any:
    plan = _plan().plan
    request = plan.request("tiny", "canary-1")
    return judge(plan, request, Received(Streamed(tuple(events)), 0.0, 0.1, 1.0))


@pytest.mark.parametrize(
    ("events", "outcome", "said"),
    [
        ((_token(5), _token(6), _finished()), Outcome.SUCCESS, "complete answer"),
        ((_token(5), _finished(completion=1)), Outcome.INVALID, "1 token(s)"),
        ((_token(5), _token(6), _finished(completion=3)), Outcome.INVALID, "usage"),
        ((_token(5), _finished("FINISH_REASON_CANCELLED")), Outcome.INVALID, "CANCELLED"),
        ((_token(5), _token(6)), Outcome.INVALID, "no finished event after 2"),
        (({"prefill_ready": {"kv_session": {}}},), Outcome.INVALID, "context phase only"),
        ((), Outcome.INVALID, "without an event"),
        (
            ({"error": {"code": "ERROR_CODE_INTERNAL", "message": "boom"}},),
            Outcome.ERROR,
            "engine error ERROR_CODE_INTERNAL: boom",
        ),
    ],
)
def test_a_stream_is_judged_whole(events: tuple[Any, ...], outcome: Outcome, said: str) -> None:
    result = _judged(*events)
    assert result.outcome is outcome, result.reason
    assert said in result.reason


def test_an_error_event_that_refuses_the_request_is_a_rejection_not_a_hang() -> None:
    refused = _judged({"error": {"code": "ERROR_CODE_INVALID_ARGUMENT", "message": "no"}})
    failed = _judged({"error": {"code": "ERROR_CODE_INTERNAL", "message": "boom"}})
    assert refused.rejected
    assert not refused.server_error
    assert failed.server_error
    assert not failed.rejected


# --- the registration check and the load report on a stub channel -------------------------------
class Stub:
    """A channel that answers each method with what the test says (a message, or NoAnswer)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.sent: list[CanaryRequest] = []

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        self.sent.append(request)
        got = self.answers[request.path.rpartition("/")[2]]
        answer = got if isinstance(got, NoAnswer) else Streamed((got,))
        return Received(answer, 0.0, 0.0, 0.0)

    def redact(self, text: str) -> str:
        return text


def _checked(health: dict[str, Any], **answers: Any) -> Any:
    stub = Stub({"Health": health, "GetModelInfo": {"served_model_name": "tiny"}, **answers})

    async def check() -> Any:
        registration = OpenEngineHealth(stub, role="decode", timeout=1.0, probe_every=1e9)  # type: ignore[arg-type]
        try:
            return await registration(), stub
        finally:
            await registration.aclose()

    return asyncio.run(check())


@pytest.mark.parametrize(
    ("state", "outcome", "not_serving"),
    [
        ("HEALTH_STATE_READY", Outcome.SUCCESS, False),
        ("HEALTH_STATE_DEGRADED", Outcome.SUCCESS, False),
        ("HEALTH_STATE_STARTING", Outcome.ERROR, False),
        ("HEALTH_STATE_NOT_READY", Outcome.ERROR, True),
    ],
)
def test_health_states_are_registration(state: str, outcome: Outcome, not_serving: bool) -> None:
    checked, stub = _checked({"state": state, "checks": []})
    assert checked.registration.outcome is outcome, checked.registration.reason
    assert checked.registration.not_serving is not_serving
    asked = stub.sent[0].body
    assert asked == {"role": "ENGINE_ROLE_DECODE"}  # never the engine's own probe here
    if outcome is Outcome.SUCCESS:
        assert checked.model == ("tiny", "/openengine.v1.Control/GetModelInfo names it")


def test_a_refused_health_call_is_refused_registration() -> None:
    gone = NoAnswer(Outcome.REFUSED, "Health -> UNAVAILABLE", status="UNAVAILABLE")
    checked, _ = _checked(gone)
    assert checked.registration.outcome is Outcome.REFUSED
    assert checked.model is None


def _load(answer: Any) -> tuple[str | None, str]:
    return asyncio.run(OpenEngineLoad(Stub({"GetLoad": answer}), timeout=1.0).metrics_text(""))  # type: ignore[arg-type]


def test_the_load_report_is_read_as_an_exposition() -> None:
    text, _why = _load({"running_requests": 3, "instance_id": "x"})
    assert text is not None
    assert f"{RUNNING} 3" in text
    assert f"{STALE} 0" in text
    assert QUEUED not in text


def test_a_stale_load_report_says_so_and_other_refusals_are_unreadable() -> None:
    stale = NoAnswer(
        Outcome.REFUSED,
        "GetLoad -> UNAVAILABLE: KV occupancy sample is stale while requests are active",
        status="UNAVAILABLE",
    )
    text, _ = _load(stale)
    assert text == f"{STALE} 1\n"
    text, why = _load(NoAnswer(Outcome.REFUSED, "failed to connect", status="UNAVAILABLE"))
    assert text is None
    assert "failed to connect" in why


# --- what --check-config says -------------------------------------------------------------------
def test_the_plan_says_the_stall_rule_is_off_and_names_the_load_report() -> None:
    text = render(_plan("trtllm", "decode"))
    assert "transport openengine" in text
    assert "registration   OpenEngine openengine.v1.Control/Health" in text
    assert "the stall rule is off (nothing read over openengine counts the engine's steps)" in text
    assert "load           gRPC /openengine.v1.Control/GetLoad" in text
    assert "own probe" in text


def test_the_engine_saying_not_ready_after_ready_is_a_liveness_clock() -> None:
    assert Cause.NOT_SERVING in _plan().causes
    assert Cause.STALL not in _plan().causes
