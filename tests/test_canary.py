"""The canary policy per backend and role, as a table, and the checks of an engine's answer."""

from __future__ import annotations

import asyncio

import pytest
from aiotools import VirtualClock

from sidecar.config import Settings
from sidecar.core.evidence.result import Outcome, Result
from sidecar.probes.base import CanaryRequest
from sidecar.probes.canary import Canary
from sidecar.probes.exchange import Answer, NoAnswer, Received
from sidecar.wiring import Blueprint, check, resolve
from tests.support.configured import answered_by, blueprint_from

pytestmark = pytest.mark.unit

ON = {"DYN_HEALTH_CHECK_ENABLED": "true"}


def plan_for(backend: str, mode: str, model_type: str = "text", **env: str):
    settings = Settings.model_validate(
        ON
        | {
            "SIDECAR_BACKEND": backend,
            "SIDECAR_DISAGGREGATION_MODE": mode,
            "SIDECAR_MODEL_TYPE": model_type,
        }
        | env
    )
    assert not check(settings), check(settings)
    return resolve(settings).plan


def answers(blueprint: Blueprint) -> str:
    """The route whose answer shows the engine's HTTP side is alive (its registration route)."""
    return blueprint.engine.api(blueprint.plan.role).registration_path


@pytest.mark.parametrize(
    ("backend", "mode", "path", "present", "absent"),
    [
        ("vllm", "aggregated", "/v1/completions", {"ignore_eos": True}, ["kv_transfer_params"]),
        ("vllm", "prefill", "/v1/completions", {"max_tokens": 1}, ["kv_transfer_params"]),
        ("vllm", "decode", "/v1/completions", {"temperature": 0}, ["kv_transfer_params"]),
        ("trtllm", "aggregated", "/v1/completions", {}, ["disaggregated_params"]),
        (
            "trtllm",
            "prefill",
            "/v1/completions",
            {"disaggregated_params": {"request_type": "context_and_generation"}},
            [],
        ),
        (
            "trtllm",
            "decode",
            "/v1/completions",
            {"disaggregated_params": {"request_type": "context_and_generation"}},
            [],
        ),
        ("sglang", "aggregated", "/generate", {"stream": False}, ["bootstrap_host"]),
        (
            "sglang",
            "prefill",
            "/generate",
            {"bootstrap_host": "2.2.2.2", "bootstrap_port": 8998},
            [],
        ),
        ("sglang", "decode", "/generate", {"bootstrap_host": "2.2.2.2"}, []),
        ("openai", "aggregated", "/v1/completions", {"max_tokens": 1}, ["ignore_eos"]),
    ],
)
def test_role_aware_bodies(backend, mode, path, present, absent):
    plan = plan_for(backend, mode)
    assert plan.enabled
    request = plan.request("tiny", "canary-1")
    assert (request.method, request.path) == ("POST", path)
    for key, value in present.items():
        assert request.body[key] == value
    for key in absent:
        assert key not in request.body
    assert request.request_id == "canary-1"


def test_prompt_is_shorter_than_one_kv_block():
    for backend in ("vllm", "trtllm"):
        assert len(plan_for(backend, "prefill").request("m", "r").body["prompt"]) < 16
    assert len(plan_for("sglang", "prefill").request("m", "r").body["input_ids"]) < 16


def test_sglang_room_is_fresh_per_canary_and_decode_asks_two_tokens():
    plan = plan_for("sglang", "decode")
    a, b = plan.request(None, "canary-a"), plan.request(None, "canary-b")
    assert a.body["bootstrap_room"] != b.body["bootstrap_room"]
    assert 0 <= a.body["bootstrap_room"] < 2**63
    assert a.body["sampling_params"]["max_new_tokens"] == 2
    assert a.body["rid"] == "canary-a"


@pytest.mark.parametrize(
    ("backend", "mode", "model_type", "enabled"),
    [
        ("vllm", "encode", "multimodal", True),  # the encoder's canary: a new image
        ("vllm", "encode", "text", False),  # a text model's encoder: nothing to encode
        ("sglang", "encode", "multimodal", True),  # its own encode check, GET /health
        ("trtllm", "encode", "text", False),
        ("trtllm", "encode", "multimodal", False),  # CUDA IPC handles nobody would read
        ("vllm", "decode", "multimodal", True),  # the local text canary, images or not
        ("vllm", "decode", "text", True),
        ("sglang", "decode", "multimodal", True),  # fake transfer works for the language model
        ("trtllm", "decode", "multimodal", True),
    ],
)
def test_roles_without_a_safe_probe(backend, mode, model_type, enabled):
    assert plan_for(backend, mode, model_type).enabled is enabled


def test_canaries_off():
    settings = Settings.model_validate({"SIDECAR_BACKEND": "vllm"})
    plan = resolve(settings).plan
    assert not plan.enabled
    assert "DYN_HEALTH_CHECK_ENABLED" in plan.why


def test_payload_override_gives_any_role_a_canary():
    plan = plan_for("vllm", "encode", "multimodal", DYN_HEALTH_CHECK_PAYLOAD='{"prompt": "p"}')
    assert plan.enabled
    request = plan.request(None, "canary-1")
    assert request.body == {"prompt": "p"}
    assert request.expected_tokens is None


def completion(finish="length", tokens=1, **extra):
    return {
        "choices": [{"index": 0, "text": "x", "finish_reason": finish}],
        "usage": {"prompt_tokens": 8, "completion_tokens": tokens},
    } | extra


SGLANG_OK = {
    "text": "x",
    "meta_info": {"finish_reason": {"type": "length", "length": 2}, "completion_tokens": 2},
}


@pytest.mark.parametrize(
    ("backend", "mode", "answer", "problem"),
    [
        ("vllm", "aggregated", completion(), None),
        ("vllm", "aggregated", completion(finish="stop"), "finish_reason 'stop'"),
        ("vllm", "aggregated", completion(tokens=2), "completion_tokens 2"),
        ("vllm", "aggregated", {"choices": []}, "no choices"),
        ("vllm", "aggregated", {"choices": [{"text": "x"}]}, "no finish_reason"),
        ("vllm", "aggregated", [1, 2], "not a JSON object"),
        ("vllm", "aggregated", {"error": {"message": "boom"}}, "engine error in body: boom"),
        ("trtllm", "decode", completion(), None),
        ("openai", "aggregated", completion(finish="stop", tokens=0), None),
        ("openai", "aggregated", completion(tokens=3), "completion_tokens 3"),
        ("sglang", "decode", SGLANG_OK, None),
        ("sglang", "decode", {"text": "x"}, "no meta_info"),
        ("sglang", "decode", {"meta_info": {"completion_tokens": 2}}, "finish_reason"),
        ("sglang", "aggregated", SGLANG_OK, "completion_tokens 2, expected 1"),
    ],
)
def test_answer_checks(backend, mode, answer, problem):
    plan = plan_for(backend, mode)
    request = plan.request("tiny", "canary-1")
    found = plan.problem(answer, request.expected_tokens)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


class _FrozenServer:
    """A channel to a server that accepts and never answers (llama-server frozen whole)."""

    def __init__(self) -> None:
        self.sent = 0

    def redact(self, text: str) -> str:
        return text

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        if request.method == "GET":  # the registration route: no answer either
            return _received(NoAnswer(Outcome.TIMEOUT, "no answer"))
        self.sent += 1
        await asyncio.sleep(3600)
        raise AssertionError("a frozen server never answers")


def _received(answer: Answer | NoAnswer) -> Received:
    now = asyncio.get_running_loop().time()
    return Received(answer, now, now, 0.0)


def test_a_kept_canary_is_the_only_one_sent_and_ends_with_its_probe(monkeypatch) -> None:
    """The openai (llama-server) probe keeps its timed-out canary on the connection: later
    probes send no other while it waits, and closing the probe cancels it (no task outlives the
    monitor)."""
    on = {"DYN_HEALTH_CHECK_ENABLED": "true", "SIDECAR_MODEL": "tiny"}
    blueprint = blueprint_from(monkeypatch, SIDECAR_BACKEND="openai", **on)
    plan = blueprint.plan

    async def main() -> None:
        with VirtualClock().patch_loop():
            engine = _FrozenServer()
            loop = asyncio.get_running_loop()
            probe = Canary(
                engine,
                timeout=0.05,
                answers=answered_by(engine, answers(blueprint)),
                clock=loop.time,
            )
            results = [
                await probe(plan, plan.request("tiny", f"canary-{n}"), "tiny") for n in range(3)
            ]
            assert [r.outcome for r in results] == [Outcome.TIMEOUT] * 3
            assert {r.request_id for r in results} == {"canary-0"}  # the one still on the engine
            assert engine.sent == 1
            await probe.aclose()
            assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


class _SlowSglang:
    """A channel whose canaries time out, and whose abort route answers ``status`` (None: no
    answer at all)."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.sent: list[CanaryRequest] = []

    def redact(self, text: str) -> str:
        return text

    async def send(self, request: CanaryRequest, deadline: float) -> Received:
        if request.path != "/abort_request":
            return _received(NoAnswer(Outcome.TIMEOUT, "no complete answer within 0.05 s"))
        self.sent.append(request)
        if self.status is None:
            return _received(NoAnswer(Outcome.REFUSED, "POST /abort_request: cannot connect"))
        return _received(Answer(self.status, "application/json", b"{}", None))


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (200, "; stopped on the engine (POST /abort_request -> 200)"),
        (500, "; its abort failed (POST /abort_request -> 500)"),
        (None, "; its abort failed (POST /abort_request: cannot connect)"),
    ],
)
def test_a_timed_out_sglang_canary_is_aborted_by_rid_and_says_so(monkeypatch, status, said):
    blueprint = blueprint_from(
        monkeypatch, SIDECAR_BACKEND="sglang", DYN_HEALTH_CHECK_ENABLED="true"
    )
    plan = blueprint.plan
    engine = _SlowSglang(status)
    request = plan.request(None, "canary-1")

    async def main() -> Result:
        return await Canary(engine, timeout=0.05, answers=answered_by(engine, answers(blueprint)))(
            plan, request, None
        )

    result = asyncio.run(main())
    assert result.outcome is Outcome.TIMEOUT
    assert result.reason.endswith(said)
    (abort,) = engine.sent
    assert (abort.method, abort.path, abort.body) == ("POST", "/abort_request", {"rid": "canary-1"})
