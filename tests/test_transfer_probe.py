"""The transfer probe (SIDECAR_KV_PEER_URL): its requests, its verdict rules, and the sidecar
against a fake prefill/decode pair as real processes over loopback. The real pair over NIXL:
tests/test_vllm_real.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_registration,
    apply_transfers,
    maintenance_due,
    transfer_due,
)
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.evidence.transfers import TransferSample
from sidecar.core.verdict import Rule, Verdict, decide_readiness
from sidecar.core.vocabulary import StartingStatus
from sidecar.probes.transfer import REMOTE_DECODE, bodies, generated, probe_prompt, transfer_params
from tests.support.harness import wait_until
from tests.support.tables import POLICY

R, N = Verdict(True, "ok"), Verdict(False, "canary timeout: the transfer probe did not finish")


@pytest.mark.unit
def test_each_probe_has_a_prompt_and_cache_salts_of_its_own():
    one, two = bodies("tiny", 256, 1, "kv-probe-a"), bodies("tiny", 256, 2, "kv-probe-b")
    assert one.prefill["prompt"] != two.prefill["prompt"]
    assert len(one.prefill["prompt"]) == 256
    assert all(100 <= t < 500 for t in probe_prompt(300, 7))
    # The peer keeps the KV for a decoder; the reference computes from scratch.
    assert one.prefill["kv_transfer_params"] == REMOTE_DECODE
    assert one.prefill["max_tokens"] == 1
    assert one.local["cache_salt"] != one.prefill["cache_salt"]
    assert "kv_transfer_params" not in one.local
    params = {"do_remote_prefill": True, "remote_block_ids": [0, 1]}
    decode = one.decode(params)
    assert decode["kv_transfer_params"] == params
    assert decode["prompt"] == one.local["prompt"]
    assert decode["max_tokens"] == one.local["max_tokens"]
    assert decode["cache_salt"] == one.prefill["cache_salt"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answer", "params"),
    [
        ({"kv_transfer_params": {"do_remote_prefill": True, "x": 1}}, True),
        ({"kv_transfer_params": {"do_remote_prefill": False}}, False),
        ({"kv_transfer_params": None}, False),
        ({"choices": []}, False),
        ([], False),
    ],
)
def test_the_peer_must_say_where_to_pull_from(answer, params):
    assert (transfer_params(answer) is not None) is params


@pytest.mark.unit
def test_generated_text():
    assert generated({"choices": [{"text": " ab"}]}) == " ab"
    assert generated({"choices": []}) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kv", "listed", "ready", "rule"),
    [
        (N, (), True, Rule.MONITORED),  # informs only, by default
        (N, ("generate",), True, Rule.LISTED),
        (N, ("generate", "kv_transfer"), False, Rule.LISTED),
        (R, ("generate", "kv_transfer"), True, Rule.LISTED),
    ],
)
def test_kv_transfer_gates_readiness_only_when_listed(kv, listed, ready, rule):
    verdicts = {"generate": R, "kv_transfer": kv}
    got = decide_readiness(verdicts, listed, StartingStatus.NOTREADY, informing=("kv_transfer",))
    assert (got.ready, got.rule) == (ready, rule)


# --- against a fake prefill/decode pair ---------------------------------------------------------
def probed(outcome: Outcome, at: float) -> EndpointState:
    """A registered kv_transfer endpoint whose one probe ran from ``at`` to ``at`` + 0.5."""
    up = Result(Outcome.SUCCESS, "ok", 0.0, 0.01, 1e9)
    ep = apply_registration(EndpointState("kv_transfer", True, "why", liveness=False), up, POLICY)
    done = Result(outcome, "probe", at, at + 0.5, 1e9 + at)
    return apply_canary(ep, done, ep.incarnation, POLICY)


def failed_transfer_at(at: float) -> EndpointState:
    ep = EndpointState("generate", True, "why")
    ep = apply_transfers(ep, TransferSample(at - 1, 1e9, {"failed": 0.0}))
    return apply_transfers(ep, TransferSample(at, 1e9, {"failed": 1.0}))


INTERVAL = 60.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("ep", "others", "due", "why"),
    [
        (EndpointState("kv_transfer", True, "why"), (), None, "not registered: nothing"),
        (probed(Outcome.SUCCESS, 10.0), (), 10.5 + INTERVAL, "passing: every interval"),
        (probed(Outcome.TIMEOUT, 10.0), (), 10.5 + POLICY.retry, "failing: every retry"),
        (probed(Outcome.SUCCESS, 10.0), (failed_transfer_at(20.0),), 11.0, "failed since: at once"),
        (probed(Outcome.SUCCESS, 10.0), (failed_transfer_at(9.0),), 70.5, "failed before: wait"),
    ],
)
def test_when_the_transfer_probe_is_due(ep, others, due, why):
    assert transfer_due(ep, others, POLICY, INTERVAL, now=30.0) == due, why


@pytest.mark.unit
def test_a_first_probe_is_due_at_once_and_a_paused_engine_gets_none():
    up = Result(Outcome.SUCCESS, "ok", 0.0, 0.01, 1e9)
    fresh = apply_registration(EndpointState("kv_transfer", True, "why"), up, POLICY)
    assert transfer_due(fresh, (), POLICY, INTERVAL, now=3.0) == 3.0
    asleep = lifecycle.start_maintenance(fresh.lifecycle, "upgrade", 60.0, 3.0, 1e9)
    paused = replace(fresh, lifecycle=asleep)
    assert transfer_due(paused, (), POLICY, INTERVAL, now=3.0) is None
    assert maintenance_due([fresh, paused]) == asleep.maintenance
    assert maintenance_due([fresh]) is None


def pair(engine, sidecar, **extra: str):
    prefill = engine("vllm", "prefill")
    decode = engine("vllm", "decode")
    env = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_ENGINE_URL": decode.url,
        "SIDECAR_DISAGGREGATION_MODE": "decode",
        "SIDECAR_KV_PEER_URL": prefill.url,
        "SIDECAR_KV_PROBE_INTERVAL": "1",
        "SIDECAR_KV_PROBE_TIMEOUT": "1",
        "SIDECAR_KV_PROBE_PROMPT_TOKENS": "40",
    } | extra
    return prefill, decode, sidecar(env)


def kv_check(side) -> dict:
    return side.get("/health").json()["checks"]["kv_transfer"]


@pytest.mark.process
def test_a_healthy_pair_passes_and_a_frozen_peer_informs_without_a_503(engine, sidecar):
    prefill, decode, side = pair(engine, sidecar)
    side.wait_status(200, 5)
    wait_until(lambda: kv_check(side)["reason"].startswith("canary passed"), 5, what="a probe")
    # What reached the engines: the peer's prefill leg, the decode leg with its parameters.
    legs = [r for r in prefill.requests() if r["path"] == "/v1/completions"]
    assert any(r["json"].get("kv_transfer_params") == REMOTE_DECODE for r in legs)
    decoded = [r for r in decode.requests() if (r.get("json") or {}).get("kv_transfer_params")]
    assert decoded, "no decode leg reached the decode worker"
    assert decoded[0]["json"]["kv_transfer_params"]["do_remote_prefill"] is True

    decode.fault(kv_transfer_failure="peer_frozen")  # the peer froze after the handshake
    wait_until(lambda: kv_check(side)["consecutive_failures"] >= 2, 6, what="two failed probes")
    status, body = side.health()
    assert status == 200  # informs only: not listed in DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS
    assert body["endpoints"]["kv_transfer"] == "notready"
    assert "the transfer probe did not finish within 1 s" in kv_check(side)["reason"]
    assert side.get("/live").status_code == 200
    assert body["checks"]["kv_transfer"]["hard_failure_since"] is not None
    live = side.get("/live").json()
    assert "kv_transfer" not in live["reason"]  # never a liveness clock
    decode.fault(kv_transfer_failure="none")
    wait_until(lambda: kv_check(side)["reason"].startswith("canary passed"), 6, what="recovery")


@pytest.mark.process
def test_listed_kv_transfer_gates_readiness_and_a_dead_peer_is_named(engine, sidecar):
    prefill, _, side = pair(
        engine, sidecar, DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS='["generate", "kv_transfer"]'
    )
    side.wait_status(200, 5)
    prefill.close()  # the peer is gone
    side.wait_status(503, 6)
    _, body = side.health()
    assert body["endpoints"] == {"generate": "ready", "kv_transfer": "notready"}
    assert "kv_transfer: canary refused: prefill peer: cannot connect" in body["reason"]
    assert side.get("/live").status_code == 200


@pytest.mark.process
def test_a_transfer_that_brings_corrupted_kv_is_a_wrong_answer(engine, sidecar):
    """The transfer completes and the decode answers 200, but the pulled KV is corrupted: only
    the comparison with a local prefill tells."""
    _, decode, side = pair(engine, sidecar)
    side.wait_status(200, 5)
    wait_until(lambda: kv_check(side)["reason"].startswith("canary passed"), 5, what="a probe")
    decode.fault(kv_corrupt=True)
    wait_until(lambda: kv_check(side)["consecutive_failures"] >= 2, 6, what="two failed probes")
    check = kv_check(side)
    assert check["last_canary"]["outcome"] == "wrong_answer"
    assert "the transferred KV decodes to" in check["reason"]
    assert "corrupted KV" in check["reason"]
    assert side.health()[0] == 200  # informs
    assert side.get("/live").status_code == 200
    decode.fault(kv_corrupt=False)
    wait_until(lambda: kv_check(side)["reason"].startswith("canary passed"), 6, what="recovery")
