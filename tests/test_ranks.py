"""Data-parallel ranks as tables: the rank policy, pinning, per-rank metrics and configuration.
Pure functions; the ranks against engines are in tests/test_ranks_inprocess.py (the fake, in
process) and tests/test_vllm_dp.py."""

from __future__ import annotations

import pytest

from sidecar.config import ConfigError, Settings
from sidecar.core.evidence.progress import ranks_in, read_progress
from sidecar.core.verdict import Verdict, rank_verdict
from sidecar.probes.base import CanaryPlan
from sidecar.wiring import check, load, resolve

pytestmark = pytest.mark.unit

R = Verdict(True, "canary passed in 9 ms")
N = Verdict(False, "canary timeout: no complete answer within 3 s")
U = Verdict(None, "registered; waiting for the first canary")


@pytest.mark.parametrize(
    ("ranks", "need", "ready", "degraded", "reason"),
    [
        ((R, R), None, True, False, "2 of 2 ranks ready"),
        ((R, N), None, False, False, "1 of 2 ranks ready, 2 required; g/rank1: canary timeout"),
        ((R, N), 1, True, True, "degraded: 1 of 2 ranks ready, 1 required; g/rank1: canary"),
        ((N, N), 1, False, False, "0 of 2 ranks ready, 1 required; g/rank0: canary timeout"),
        ((R, U), None, None, False, "1 of 2 ranks ready, 2 required; no verdict yet for g/rank1"),
        ((R, U), 1, True, True, "degraded: 1 of 2 ranks ready, 1 required; no verdict yet for"),
        ((U, N), 1, None, False, "0 of 2 ranks ready, 1 required; no verdict yet for g/rank0"),
        ((R, R, N, N), 2, True, True, "degraded: 2 of 4 ranks ready, 2 required; g/rank2: canary"),
        ((R, N), 5, False, False, "1 of 2 ranks ready, 2 required"),  # capped at the count
    ],
)
def test_rank_policy(ranks, need, ready, degraded, reason):
    verdict = rank_verdict({f"g/rank{i}": v for i, v in enumerate(ranks)}, need)
    assert verdict.ready is ready
    assert verdict.degraded is degraded
    assert verdict.reason.startswith(reason), verdict.reason


def settings(**env: str) -> Settings:
    made = Settings.model_validate({"DYN_HEALTH_CHECK_ENABLED": "true", **env})
    assert not check(made), check(made)
    return made


def plan_of(**env: str) -> CanaryPlan:
    """The generate endpoint's plan, as the sidecar resolves it for ``env``."""
    return resolve(settings(**env)).plan


def test_vllm_pins_with_the_header_and_sglang_with_the_body_field():
    vllm = plan_of().for_rank(1)
    request = vllm.request("tiny", "canary-x")
    assert request.headers == {"X-data-parallel-rank": "1"}
    assert "data_parallel_rank" not in request.body  # vLLM ignores it; the header pins
    assert vllm.unit == "generate/rank1"
    sglang = plan_of(SIDECAR_BACKEND="sglang").for_rank(3).request(None, "c")
    assert sglang.body["data_parallel_rank"] == 3
    assert sglang.headers == {}
    unpinned = plan_of().request("tiny", "canary-y")
    assert unpinned.headers == {}


VLLM_DP = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 48.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 96.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 6.0
vllm:generation_tokens_total{engine="1",model_name="tiny"} 7.0
"""


def test_each_rank_reads_its_own_series():
    plan = plan_of()
    one = read_progress(VLLM_DP, plan.for_rank(1).progress_spec(), 1.0, 1.0)
    assert one.in_flight == 3.0
    assert one.counters["prompt"] == 96.0
    zero = read_progress(VLLM_DP, plan.for_rank(0).progress_spec(), 1.0, 1.0)
    assert zero.in_flight == 0.0
    assert zero.counters["generation"] == 6.0
    every = read_progress(VLLM_DP, plan.progress_spec(), 1.0, 1.0)  # unpinned: the sum
    assert every.counters["prompt"] == 144.0
    # SIDECAR_METRICS_PATH is where every rank's series are read.
    custom = plan_of(SIDECAR_METRICS_PATH="/custom")
    assert custom.for_rank(1).progress_spec().path == "/custom"


def test_ranks_are_counted_from_the_in_flight_gauges():
    spec = plan_of().progress_spec()
    gauges = (*spec.running, *spec.waiting)
    assert ranks_in(VLLM_DP, gauges, "engine") == (0, 1)
    single = 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
    assert ranks_in(single, gauges, "engine") == (0,)
    # The gauges without the label: one rank (SGLang with one rank labels no series dp_rank).
    assert ranks_in("vllm:num_requests_running 0.0\n", gauges, "engine") == (0,)
    assert ranks_in("vllm:other_gauge 0.0\n", gauges, "engine") == ()
    assert ranks_in("not an exposition {", gauges, "engine") == ()


# A real SGLang 0.5.23 with --dp-size 2, cut to the series read: the schedulers' series carry
# dp_rank, the tokenizer manager's counters do not.
SGLANG_DP = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:realtime_tokens counter
sglang:realtime_tokens_total{dp_rank="0",engine_type="unified",mode="prefill_compute",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 80.0
sglang:realtime_tokens_total{dp_rank="0",engine_type="unified",mode="decode",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 400.0
sglang:realtime_tokens_total{dp_rank="1",engine_type="unified",mode="prefill_compute",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 16.0
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="tiny"} 96.0
# TYPE sglang:num_requests counter
sglang:num_requests_total{engine_type="unified",is_streaming="false",model_name="tiny"} 12.0
"""  # noqa: E501


def test_sglang_ranks_are_counted_and_read_from_the_schedulers_series():
    plan = plan_of(SIDECAR_BACKEND="sglang")
    spec = plan.progress_spec()
    assert ranks_in(SGLANG_DP, (*spec.running, *spec.waiting), "dp_rank") == (0, 1)
    zero = read_progress(SGLANG_DP, plan.for_rank(0).progress_spec(), 1.0, 1.0)
    assert zero.in_flight == 3.0
    assert zero.counters == {"prompt": 80.0, "generation": 400.0}
    one = read_progress(SGLANG_DP, plan.for_rank(1).progress_spec(), 1.0, 1.0)
    assert (one.in_flight, one.counters) == (0.0, {"prompt": 16.0})
    every = read_progress(SGLANG_DP, spec, 1.0, 1.0)  # unpinned: every rank, and completions
    assert every.counters == {"prompt": 96.0, "generation": 400.0, "completed": 12.0}


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"SIDECAR_BACKEND": "trtllm", "SIDECAR_DP_RANKS": "2"}, "SIDECAR_DP_RANKS=2: expected 1"),
        ({"SIDECAR_BACKEND": "openai", "SIDECAR_DP_RANKS": "auto"}, "SIDECAR_DP_RANKS=auto"),
        (
            {"SIDECAR_DP_RANKS": "2", "SIDECAR_DP_MIN_READY_RANKS": "3"},
            "SIDECAR_DP_MIN_READY_RANKS=3: expected",
        ),
        ({"SIDECAR_DP_RANKS": "1025"}, "SIDECAR_DP_RANKS='1025'"),
        ({"SIDECAR_DP_RANKS": "two"}, "SIDECAR_DP_RANKS='two'"),
    ],
)
def test_rank_settings_are_refused_with_one_line(monkeypatch, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load()
    assert len(info.value.lines) == 1
    assert info.value.lines[0].startswith(line), info.value.lines


@pytest.mark.parametrize(("value", "parsed"), [("1", 1), ("8", 8), ("auto", "auto"), (" 4 ", 4)])
def test_rank_counts(monkeypatch, value, parsed):
    monkeypatch.setenv("SIDECAR_DP_RANKS", value)
    assert load().dp_ranks == parsed


@pytest.mark.parametrize(
    ("env", "ranks"),
    [
        ({"SIDECAR_BACKEND": "vllm"}, "auto"),
        ({"SIDECAR_BACKEND": "sglang"}, "auto"),
        ({"SIDECAR_BACKEND": "vllm", "SIDECAR_DP_RANKS": "1"}, 1),  # the way to turn it off
        ({"SIDECAR_BACKEND": "trtllm"}, 1),  # cannot pin a request to a rank
        ({"SIDECAR_BACKEND": "openai"}, 1),
        ({"SIDECAR_BACKEND": "vllm", "SIDECAR_TRANSPORT": "dynamo", "DYN_FILE_KV": "/tmp"}, 1),
    ],
)
def test_ranks_are_counted_by_default_where_the_engine_can_tell_them(monkeypatch, env, ranks):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve(load()).ranks == ranks
