"""The gRPC transport's probers (SIDECAR_TRANSPORT=grpc), pure: the request per backend and role,
the judgement of a call's messages (deltas counted once, abort and error inside an OK status
failed), the engine's Abort, and the configuration's rules. Over real sockets, against the fake
engine's gRPC services: tests/test_grpc_transport.py; against vLLM's real gRPC server:
tests/test_vllm_grpc.py."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config import ConfigError
from sidecar.core.evidence.result import Outcome
from sidecar.core.vocabulary import Mode
from sidecar.engines.base import FAKE_BOOTSTRAP_HOST
from sidecar.probes.base import CanaryPlan
from sidecar.probes.exchange import Received, Streamed
from sidecar.probes.judge import judge
from sidecar.tools.plan import render as render_plan
from sidecar.tools.probes import render as render_probes
from sidecar.tools.probes import size
from sidecar.transports.grpc import health_target, prober_class
from tests.support.configured import blueprint_from, blueprint_of, settings_from

pytestmark = pytest.mark.unit

GRPC = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "SIDECAR_TRANSPORT": "grpc",
    "SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051",
}


def plan(backend: str, mode: Mode = Mode.AGGREGATED, **fields: object) -> CanaryPlan:
    """The generate endpoint's plan of a text model's worker over gRPC, canaries on."""
    return blueprint_of(
        backend=backend,
        disaggregation_mode=mode,
        transport="grpc",
        engine_url="grpc://127.0.0.1:50051",
        health_check_enabled=True,
        **fields,
    ).plan


def received(*messages: dict[str, Any]) -> Received:
    return Received(Streamed(tuple(messages)), 0.0, 0.01, 0.0)


@pytest.mark.parametrize("mode", list(Mode)[:3])
def test_vllm_sends_a_plain_local_generation_in_every_role(mode):
    p = plan("vllm", mode)
    request = p.request(None, "canary-1")
    assert (p.enabled, p.probe, p.path) == (
        True,
        "grpc",
        "/vllm.grpc.engine.VllmEngine/Generate",
    )
    assert request.body == {
        "request_id": "canary-1",
        "tokenized": {"original_text": "", "input_ids": [100, 101, 102, 103, 104, 105, 106, 107]},
        "sampling_params": {"temperature": 0, "max_tokens": 2, "ignore_eos": True},
        "stream": False,
    }
    assert request.expected_tokens == 2


@pytest.mark.parametrize(
    ("mode", "params"),
    [
        (Mode.AGGREGATED, None),
        (Mode.PREFILL, {"request_type": "REQUEST_TYPE_CONTEXT_AND_GENERATION"}),
        (Mode.DECODE, {"request_type": "REQUEST_TYPE_CONTEXT_AND_GENERATION"}),
    ],
)
def test_trtllm_prefill_and_decode_carry_disaggregated_params(mode, params):
    """DIS-1737's rule over gRPC: TensorRT-LLM decode refuses a request without them."""
    p = plan("trtllm", mode)
    body = p.request(None, "canary-1").body
    assert p.path == "/trtllm.TrtllmService/Generate"
    assert body.get("disaggregated_params") == params
    assert body["tokenized"]["input_token_ids"]
    assert body["max_tokens"] == 2


@pytest.mark.parametrize("mode", [Mode.PREFILL, Mode.DECODE])
def test_sglang_prefill_and_decode_carry_the_fake_transfers_bootstrap(mode):
    p = plan("sglang", mode)
    first, second = (p.request(None, f"canary-{n}").body for n in (1, 2))
    params = first["disaggregated_params"]
    assert params["bootstrap_host"] == FAKE_BOOTSTRAP_HOST
    assert params["bootstrap_port"] == 8998
    assert 0 <= params["bootstrap_room"] < 1 << 31  # an int32 in this proto
    assert second["disaggregated_params"]["bootstrap_room"] != params["bootstrap_room"]
    assert "disaggregated_params" not in plan("sglang").request(None, "c").body


def test_an_encode_worker_gets_no_canary_over_grpc_and_says_so():
    p = plan("vllm", Mode.ENCODE, model_type="multimodal")
    assert p.enabled is False
    assert "no encode canary is known for vllm over grpc" in p.why


COMPLETE = {"complete": {"output_ids": [5, 6], "finish_reason": "length", "completion_tokens": 2}}


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ((COMPLETE,), None),
        # streamed: deltas, and a complete that repeats the last one (vLLM, SGLang's scheduler)
        (
            (
                {"chunk": {"token_ids": [5]}},
                {"chunk": {"token_ids": [6]}},
                COMPLETE | {"complete": {"output_ids": [6], "finish_reason": "length"}},
            ),
            None,
        ),
        (({"complete": {"output_ids": [5, 6], "finish_reason": "stop"}},), None),
        ((), "the call ended without a message"),
        (({"chunk": {"token_ids": [5]}},), "no complete message after 1 chunk(s)"),
        (({"complete": {"output_ids": [], "finish_reason": "abort"}},), "finish_reason 'abort'"),
        (({"complete": {"finish_reason": "error"}},), "finish_reason 'error'"),
        (({"complete": {"output_ids": [5, 6]}},), "no finish_reason"),
        (
            ({"complete": {"output_ids": [5], "finish_reason": "length"}},),
            "1 token(s) in output_ids",
        ),
        (
            (
                {"chunk": {"token_ids": [5]}},
                {"complete": {"output_ids": [5, 6], "finish_reason": "length"}},
            ),
            "1 token(s) over 1 chunk(s)",
        ),
        (({"complete": COMPLETE["complete"] | {"completion_tokens": 3}},), "completion_tokens 3"),
    ],
)
def test_a_vllm_call_is_judged_whole(messages, problem):
    p = plan("vllm")
    request = p.request(None, "canary-1")
    result = judge(p, request, received(*messages))
    if problem is None:
        assert result.outcome is Outcome.SUCCESS, result.reason
    else:
        assert result.outcome is Outcome.INVALID
        assert result.reason.startswith(problem), result.reason


def test_trtllms_streamed_complete_is_cumulative_and_not_counted_twice():
    p = plan("trtllm")
    messages = (
        {"chunk": {"token_ids": [5]}},
        {"chunk": {"token_ids": [6]}},
        {"complete": {"output_token_ids": [5, 6], "finish_reason": "length"}},
    )
    assert judge(p, p.request(None, "c"), received(*messages)).outcome is Outcome.SUCCESS
    whole = ({"complete": {"output_token_ids": [5, 6], "finish_reason": "length"}},)
    assert judge(p, p.request(None, "c"), received(*whole)).outcome is Outcome.SUCCESS


@pytest.mark.parametrize(
    ("backend", "path", "body"),
    [
        ("vllm", "/vllm.grpc.engine.VllmEngine/Abort", {"request_ids": ["canary-1"]}),
        ("trtllm", "/trtllm.TrtllmService/Abort", {"request_id": "canary-1"}),
        (
            "sglang",
            "/sglang.grpc.scheduler.SglangScheduler/Abort",
            {"request_id": "canary-1"},
        ),
    ],
)
def test_a_timed_out_canary_is_aborted_by_its_request_id(backend, path, body):
    p = plan(backend)
    abort = p.prober.abort(p.request(None, "canary-1"))
    assert abort is not None
    assert (abort.path, abort.body) == (path, body)


def test_a_users_payload_is_aborted_only_by_its_own_request_id():
    p = plan("vllm", health_check_payload={"tokenized": {"input_ids": [1]}})
    assert p.override is not None
    assert p.prober.abort(p.request(None, "canary-1")) is None


@pytest.mark.parametrize(
    ("env", "line", "also"),
    [
        (
            GRPC | {"SIDECAR_ENGINE_URL": "http://127.0.0.1:8000"},
            "SIDECAR_ENGINE_URL='http://127.0.0.1:8000': expected grpc://HOST:PORT",
            "with SIDECAR_TRANSPORT=grpc",
        ),
        (
            {"SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051"},
            "SIDECAR_ENGINE_URL='grpc://127.0.0.1:50051': expected an http(s) URL",
            "SIDECAR_TRANSPORT=http",
        ),
        (
            GRPC | {"SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051/vllm.grpc.engine.VllmEngine"},
            "SIDECAR_ENGINE_URL='grpc://127.0.0.1:50051/vllm.grpc.engine.VllmEngine': expected",
            "grpc://HOST:PORT",
        ),
        (
            GRPC | {"SIDECAR_BACKEND": "openai"},
            "SIDECAR_BACKEND='openai': expected one of vllm, sglang, trtllm with "
            "SIDECAR_TRANSPORT=grpc",
            "",
        ),
        (
            {"SIDECAR_METRICS_URL": "http://127.0.0.1:8001"},
            "SIDECAR_METRICS_URL='http://127.0.0.1:8001': expected unset",
            "with SIDECAR_TRANSPORT=grpc",
        ),
        (
            GRPC | {"SIDECAR_CANARY_PATH": "/generate"},
            "SIDECAR_CANARY_PATH='/generate': expected unset with SIDECAR_TRANSPORT=grpc",
            "",
        ),
    ],
)
def test_the_grpc_configuration_is_refused_with_one_line(monkeypatch, env, line, also):
    """Each line names the variable, its value and what was expected (sidecar.config)."""
    with pytest.raises(ConfigError) as refused:
        settings_from(monkeypatch, **env)
    (said,) = refused.value.lines
    assert said.startswith(line), said
    assert also in said, said


def test_registration_is_the_servers_grpc_health_or_getmodelinfo(monkeypatch):
    vllm = blueprint_from(monkeypatch, **GRPC)
    target = health_target(vllm.settings, prober_class(vllm.settings))
    assert target is not None
    assert (target.address, target.service) == ("127.0.0.1:50051", "")
    assert vllm.route.checking.asked == "grpc.health.v1 Check('') at 127.0.0.1:50051"
    trtllm = blueprint_from(monkeypatch, **GRPC, SIDECAR_BACKEND="trtllm")
    # its GetModelInfo call (sidecar/runtime/grpcchannel.py, RpcRegistration)
    assert health_target(trtllm.settings, prober_class(trtllm.settings)) is None
    assert trtllm.route.checking.asked == "gRPC /trtllm.TrtllmService/GetModelInfo"
    assert plan("trtllm").prober.registration == "/trtllm.TrtllmService/GetModelInfo"


def test_without_a_metrics_url_no_metrics_are_read_and_the_stall_rule_is_off(monkeypatch):
    """vLLM's gRPC server serves no metrics: the canary alone decides, --check-config and the
    probes promise no bound under load; SIDECAR_METRICS_URL (SGLang's side server) reads them."""
    bare = blueprint_from(monkeypatch, **GRPC)
    assert bare.timing.metrics is None
    assert not bare.metrics_read
    assert size(bare, 600).stall_to_notready is None
    assert "SIDECAR_METRICS_URL unset" in render_plan(bare)
    assert "Under load" not in render_probes(bare, 600)
    url = "http://127.0.0.1:30001"
    side = blueprint_from(monkeypatch, **GRPC, SIDECAR_BACKEND="sglang", SIDECAR_METRICS_URL=url)
    assert side.timing.metrics is not None
    assert size(side, 600).stall_to_notready is not None
    assert f"GET {url}/metrics every" in render_plan(side)


NATIVE = "sglang.runtime.v1.SglangService"


def native_plan(mode: Mode = Mode.AGGREGATED) -> CanaryPlan:
    return plan("sglang", mode, grpc_service=NATIVE)


def test_sglangs_native_service_takes_its_own_request():
    p = native_plan(Mode.DECODE)
    body = p.request(None, "canary-1").body
    assert p.path == f"/{NATIVE}/Generate"
    assert body["rid"] == "canary-1"
    assert body["input_ids"] == [100, 101, 102, 103, 104, 105, 106, 107]
    assert body["sampling_params"] == {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    assert body["disaggregated_params"]["bootstrap_host"] == FAKE_BOOTSTRAP_HOST
    assert body["disaggregated_params"]["bootstrap_room"] >= 0  # 64-bit in this service
    assert p.prober.registration == f"/{NATIVE}/GetModelInfo"  # its grpc.health.v1: none
    abort = p.prober.abort(p.request(None, "canary-1"))
    assert abort is not None
    assert (abort.path, abort.body) == (f"/{NATIVE}/Abort", {"rid": "canary-1"})


def _native(ids: list[int], finish: str | None, finished: bool = True) -> dict[str, Any]:
    meta = {"finish_reason": "null" if finish is None else f'{{"type": "{finish}"}}'}
    return {"output_ids": ids, "meta_info": meta, "finished": finished}


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ((_native([5, 6], "length"),), None),
        # streamed: cumulative ids, the last message holds them all
        ((_native([5], None, False), _native([5, 6], "length")), None),
        ((_native([5, 6], "stop"),), None),
        ((_native([5], None, False),), "no finished message in 1 message(s)"),
        ((_native([], "abort"),), "finish_reason 'abort'"),
        ((_native([5], "length"),), "1 token(s) in output_ids, expected 2"),
        (({"output_ids": [5, 6], "finished": True},), "no meta_info.finish_reason"),
    ],
)
def test_a_native_sglang_call_is_judged_on_its_last_cumulative_message(messages, problem):
    p = native_plan()
    result = judge(p, p.request(None, "canary-1"), received(*messages))
    if problem is None:
        assert result.outcome is Outcome.SUCCESS, result.reason
    else:
        assert result.outcome is Outcome.INVALID
        assert result.reason.startswith(problem), result.reason


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            GRPC | {"SIDECAR_GRPC_SERVICE": NATIVE},
            f"SIDECAR_GRPC_SERVICE='{NATIVE}': expected one of vllm.grpc.engine.VllmEngine "
            "(SIDECAR_BACKEND=vllm)",
        ),
        (
            {"SIDECAR_GRPC_SERVICE": NATIVE, "SIDECAR_BACKEND": "sglang"},
            f"SIDECAR_GRPC_SERVICE='{NATIVE}': expected unset (SIDECAR_TRANSPORT=http",
        ),
    ],
)
def test_a_grpc_service_is_one_of_the_backends(monkeypatch, env, line):
    with pytest.raises(ConfigError) as refused:
        settings_from(monkeypatch, **env)
    (said,) = refused.value.lines
    assert said.startswith(line), said
    ok = blueprint_from(monkeypatch, **GRPC, SIDECAR_BACKEND="sglang", SIDECAR_GRPC_SERVICE=NATIVE)
    assert ok.plan.path == f"/{NATIVE}/Generate"
