"""The Dynamo request-plane transport's pure parts, as tables: which instance the worker's own
system server names, what the runtime client's errors mean, the environment the runtime sees, the
payloads per backend and role, how a streamed answer is judged, and the two new evidence sources
(discovery, the worker's own /health) in the verdict and liveness rules."""

from __future__ import annotations

import logging

import pytest

from sidecar.config import Settings
from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_discovery,
    apply_engine_health,
    apply_registration,
    canary_due,
)
from sidecar.core.evidence.discovery import DiscoveryState, on_discovery
from sidecar.core.evidence.policy import Policy
from sidecar.core.evidence.progress import MetricsUnreadable
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.verdict import Cause, clocks, decide_liveness, endpoint_verdict, engine_undersells
from sidecar.transports.dynamo import plane_config
from sidecar.transports.dynamo.base import HEALTH_CHECK_KEY, stream_problem
from sidecar.transports.dynamo.client import classify, url_safe
from sidecar.transports.dynamo.environment import client_environment
from sidecar.transports.dynamo.identity import (
    Instance,
    instances_in_metadata,
    instances_in_metrics,
    pick,
)
from sidecar.transports.dynamo.runtimelog import level_of
from sidecar.wiring import resolve

pytestmark = pytest.mark.unit

POLICY = Policy(wait=1.0, retry=1.0, timeout=0.5, liveness_window=10.0)
WORKER = "fc2c7986cab39224"
# What the real mocker (ai-dynamo 1.6.1) publishes on its system server, cut to the series read.
MOCKER_METRICS = f"""\
# HELP dynamo_component_inflight_requests Number of requests currently being processed
# TYPE dynamo_component_inflight_requests gauge
dynamo_component_inflight_requests{{dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo",worker_id="{WORKER}"}} 0
dynamo_component_inflight_requests{{dynamo_component="backend",dynamo_endpoint="worker_kv_query_source_1c33a5389d566e",dynamo_namespace="dynamo",worker_id="{WORKER}"}} 0
# HELP dynamo_component_requests_total Total number of requests processed
# TYPE dynamo_component_requests_total counter
dynamo_component_requests_total{{dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo",worker_id="{WORKER}"}} 4
"""  # noqa: E501
MOCKER = Instance("dynamo", "backend", "generate", int(WORKER, 16))


def settings(**env: str) -> Settings:
    base = {"SIDECAR_TRANSPORT": "dynamo", "DYN_HEALTH_CHECK_ENABLED": "true"}
    return Settings.model_validate(base | env)


# --- which instance is this pod's worker --------------------------------------------------------
@pytest.mark.parametrize(
    ("want", "found"),
    [
        ("generate", [MOCKER]),
        ("dynamo.backend.generate", [MOCKER]),
        ("dynamo.prefill.generate", []),
        ("clear_kv_blocks", []),
    ],
)
def test_the_instance_is_read_from_the_workers_metrics(want, found):
    assert instances_in_metrics(MOCKER_METRICS, want) == found


def test_two_generate_endpoints_are_two_instances_and_pick_says_which_variable_decides():
    other = MOCKER_METRICS.replace('dynamo_component="backend"', 'dynamo_component="prefill"', 1)
    found = instances_in_metrics(other, "generate")
    assert len(found) == 2
    instance, why = pick(found, "generate", "GET /metrics")
    assert instance is None
    assert "names 2 instances" in why
    assert "SIDECAR_DYNAMO_ENDPOINT" in why
    assert pick([MOCKER], "generate", "GET /metrics") == (
        MOCKER,
        f"dynamo.backend.generate instance {WORKER} (GET /metrics)",
    )
    assert pick([], "generate", "GET /metrics") == (
        None,
        "GET /metrics names no instance of endpoint 'generate' yet",
    )


def test_a_worker_id_that_is_not_hex_is_unreadable():
    with pytest.raises(MetricsUnreadable, match="not a hex instance id"):
        instances_in_metrics(MOCKER_METRICS.replace(WORKER, "xyz"), "generate")


# A worker's /metadata under Kubernetes discovery: Dynamo's DiscoveryMetadata (endpoints keyed
# namespace/component/endpoint, each a discovery record), as lib/runtime/src/discovery/metadata.rs
# serializes it; the transport as the TCP request plane advertises it.
METADATA = {
    "endpoints": {
        "dynamo/backend/generate": {
            "type": "Endpoint",
            "namespace": "dynamo",
            "component": "backend",
            "endpoint": "generate",
            "instance_id": int(WORKER, 16),
            "transport": {"tcp": f"10.0.0.7:41234/{WORKER}/dynamo/backend/generate"},
            "device_type": "cuda",
            "request_plane_codec": "msgpack",
        },
        "dynamo/backend/clear_kv_blocks": {
            "type": "Endpoint",
            "namespace": "dynamo",
            "component": "backend",
            "endpoint": "clear_kv_blocks",
            "instance_id": int(WORKER, 16),
            "transport": {"tcp": f"10.0.0.7:41234/{WORKER}/dynamo/backend/clear_kv_blocks"},
        },
    },
    "model_cards": {"dynamo/backend/generate": {"type": "Model", "card_json": {}}},
    "metrics_endpoints": {},
}


def test_the_instance_and_its_record_are_read_from_metadata():
    [found] = instances_in_metadata(METADATA, "generate")
    assert found == MOCKER
    assert found.record == METADATA["endpoints"]["dynamo/backend/generate"]
    assert instances_in_metadata(METADATA, "dynamo.backend.clear_kv_blocks")[0].endpoint == (
        "clear_kv_blocks"
    )
    assert instances_in_metadata({"endpoints": {}}, "generate") == []


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"model_cards": {}}, "not Dynamo's discovery metadata"),
        ([], "not Dynamo's discovery metadata"),
        ({"endpoints": {"k": {"type": "Endpoint", "namespace": "n"}}}, "without its names"),
        (
            {"endpoints": {"k": METADATA["endpoints"]["dynamo/backend/generate"] | {"instance_id": -1}}},  # noqa: E501
            "without an instance_id",
        ),
        (
            {"endpoints": {"k": METADATA["endpoints"]["dynamo/backend/generate"] | {"transport": {}}}},  # noqa: E501
            "without a transport",
        ),
    ],
)  # fmt: skip
def test_metadata_that_is_not_dynamos_is_refused(document, message):
    with pytest.raises(ValueError, match=message):
        instances_in_metadata(document, "generate")


def test_a_record_is_named_as_the_file_store_names_it():
    # The file the real mocker's runtime wrote for its second endpoint.
    key = f"dynamo/backend/worker_kv_query_source_1c33a5389d566e/{WORKER}"
    assert url_safe(key) == (
        f"dynamo%2Fbackend%2Fworker%5Fkv%5Fquery%5Fsource%5F1c33a5389d566e%2F{WORKER}"
    )


# --- what the runtime client's errors mean ----------------------------------------------------------  # noqa: E501
class CannotConnect(Exception):
    pass


class Disconnected(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "outcome", "rejected", "reason"),
    [
        (
            Exception("Unavailable: instance_id=12345 not found for endpoint dynamo/backend/generate"),  # noqa: E501
            Outcome.REFUSED, False, "not in discovery: Unavailable: instance_id=12345",
        ),
        (CannotConnect("TCP connection to 127.0.0.1:4 failed"), Outcome.REFUSED, False, "cannot connect"),  # noqa: E501
        (Exception("Unavailable: TCP connection to 127.0.0.1:4 failed"), Outcome.REFUSED, False, "cannot connect"),  # noqa: E501
        (Exception("DeadlineExceeded: TCP request to 127.0.0.1:4 timed out"), Outcome.TIMEOUT, False, "the runtime's"),  # noqa: E501
        (Disconnected("connection reset"), Outcome.ERROR, False, "the stream broke"),
        (
            Exception("Unavailable: Worker disconnected before response stream was established"),
            Outcome.ERROR, False, "the stream broke: Unavailable: Worker disconnected",
        ),
        (
            ValueError("Internal: RuntimeError: bootstrap_info is required for disaggregated decode"),  # noqa: E501
            Outcome.ERROR, True, "worker error: RuntimeError: bootstrap_info is required",
        ),
        (RuntimeError("something new"), Outcome.ERROR, True, "worker error: something new"),
        (
            ValueError("InvalidRequest: ValueError: Disaggregated params are required for decode mode"),  # noqa: E501
            Outcome.ERROR, True,
            "worker error: ValueError: Disaggregated params are required for decode mode",
        ),
    ],
)  # fmt: skip
def test_runtime_errors_are_classified(exc, outcome, rejected, reason):
    got_outcome, got_reason, got_rejected = classify(exc)
    assert (got_outcome, got_rejected) == (outcome, rejected)
    assert got_reason.startswith(reason)


def test_a_workers_refusal_is_hard_only_after_the_canary_passed_in_this_incarnation():
    """DIS-1737: a decode worker that rejects the canary from the start is misconfigured, and a
    restart would be a crash loop; one that rejects the canary it accepted before has changed."""
    refusal = Result(Outcome.ERROR, "worker error: ...", 1.0, 1.01, 1e9, "c", rejection=True)
    assert refusal.rejected
    assert not refusal.server_error
    ep = apply_registration(EndpointState("generate", True, "why"), ok(0.0), POLICY)
    first = apply_canary(ep, refusal, ep.incarnation, POLICY)
    assert first.canary.hard_since is None
    proven = apply_canary(ep, ok(0.5), ep.incarnation, POLICY)
    again = apply_canary(proven, refusal, proven.incarnation, POLICY)
    assert again.canary.hard_since == 1.0


# --- the runtime's environment ------------------------------------------------------------------------  # noqa: E501
def test_the_runtime_sees_only_what_a_client_needs():
    environ = {
        "PATH": "/usr/bin",
        "DYN_SYSTEM_PORT": "9091",  # the sidecar's own port
        "DYN_SYSTEM_HOST": "0.0.0.0",
        "DYN_CANARY_WAIT_TIME": "1.5",  # the runtime refuses fractions
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        "DYN_FILE_KV": "/srv/kv",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_REQUEST_TIMEOUT": "5",
        "NATS_SERVER": "nats://127.0.0.1:4222",
        "ETCD_ENDPOINTS": "http://127.0.0.1:2379",
    }
    env = client_environment(
        plane_config(settings(DYN_DISCOVERY_BACKEND="file")), environ, file_kv="/srv/kv"
    )
    assert env == {
        "PATH": "/usr/bin",
        "DYN_SYSTEM_PORT": "-1",
        "DYN_FILE_KV": "/srv/kv",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_REQUEST_TIMEOUT": "5",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "NATS_SERVER": "nats://127.0.0.1:4222",
        "ETCD_ENDPOINTS": "http://127.0.0.1:2379",
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_LOG": "error",
        "DYN_SDK_DISABLE_ANSI_LOGGING": "1",
    }


def test_a_users_runtime_variables_win_over_the_defaults():
    environ = {"DYN_TCP_RESPONSE_STREAM_HOST": "10.0.0.7", "DYN_LOG": "debug"}
    env = client_environment(plane_config(settings(SIDECAR_LOG_LEVEL="DEBUG")), environ)
    assert env["DYN_TCP_RESPONSE_STREAM_HOST"] == "10.0.0.7"
    assert env["DYN_LOG"] == "debug"
    assert (
        client_environment(plane_config(settings(SIDECAR_LOG_LEVEL="DEBUG")), {})["DYN_LOG"]
        == "info"
    )


@pytest.mark.parametrize(
    ("line", "level"),
    [
        (
            "2026-12-01T09:31:08.920860Z  INFO router.route_request: route request completed",
            "DEBUG",
        ),
        ("2026-12-01T09:31:08.920860Z  WARN router.route_request: route request failed", "DEBUG"),
        ("2026-12-01T09:31:08.920860Z ERROR dynamo_runtime::storage: FileStore failed", "WARNING"),
        ("thread 'tokio-runtime-worker' panicked at src/x.rs", "DEBUG"),
    ],
)
def test_the_runtimes_lines_are_debug_but_its_errors(line, level):
    assert logging.getLevelName(level_of(line)) == level


# --- payloads per backend and role ------------------------------------------------------------------  # noqa: E501
def payload(backend: str, mode: str, **env: str) -> dict:
    plan = resolve(settings(SIDECAR_BACKEND=backend, SIDECAR_DISAGGREGATION_MODE=mode, **env)).plan
    assert plan.enabled, plan.why
    return plan.request(None, "canary-1").body


@pytest.mark.parametrize("backend", ["vllm", "sglang", "trtllm"])
@pytest.mark.parametrize("mode", ["aggregated", "prefill", "decode"])
def test_every_role_gets_the_payload_its_dynamo_handler_needs(backend, mode):
    body = payload(backend, mode)
    assert body["token_ids"]
    assert "model" not in body
    disaggregated = mode != "aggregated"
    if backend == "trtllm":
        # DIS-1737: the decode handler runs a request locally only with both.
        assert body[HEALTH_CHECK_KEY] is True
        assert ("disaggregated_params" in body) is disaggregated
        if disaggregated:
            assert body["disaggregated_params"] == {"request_type": "context_and_generation"}
        assert body["stop_conditions"]["max_tokens"] == 1
    elif backend == "sglang":
        assert ("bootstrap_info" in body) is disaggregated
        assert (HEALTH_CHECK_KEY in body) is disaggregated  # as Dynamo's own payloads
        if disaggregated:
            info = body["bootstrap_info"]
            assert info["bootstrap_host"] == "2.2.2.2"
            assert info["bootstrap_port"] == 8998
            assert isinstance(info["bootstrap_room"], int)
        assert body["stop_conditions"]["max_tokens"] == (2 if mode == "decode" else 1)
    else:
        assert body[HEALTH_CHECK_KEY] is True
        assert "disaggregated_params" not in body
        assert "bootstrap_info" not in body
        assert body["stop_conditions"]["max_tokens"] == 1
    assert body["stop_conditions"]["ignore_eos"] is True


def test_an_encode_worker_gets_no_dynamo_canary_but_a_payload_gives_it_one():
    plan = resolve(settings(SIDECAR_DISAGGREGATION_MODE="encode")).plan
    assert not plan.enabled
    given = resolve(
        settings(
            SIDECAR_DISAGGREGATION_MODE="encode", DYN_HEALTH_CHECK_PAYLOAD='{"token_ids": [1]}'
        )
    ).plan
    assert given.enabled


@pytest.mark.parametrize(
    ("backend", "mode", "stamped"),
    [
        ("vllm", "decode", {HEALTH_CHECK_KEY: True}),
        ("trtllm", "aggregated", {HEALTH_CHECK_KEY: True}),
        (
            "trtllm",
            "decode",
            {HEALTH_CHECK_KEY: True, "disaggregated_params": {"request_type": "context_and_generation"}},  # noqa: E501
        ),
        ("sglang", "decode", {}),
    ],
)  # fmt: skip
def test_a_users_payload_is_stamped_as_dynamos_workers_stamp_it(backend, mode, stamped):
    body = payload(backend, mode, DYN_HEALTH_CHECK_PAYLOAD='{"token_ids": [7], "x": 1}')
    assert body == {"token_ids": [7], "x": 1} | stamped


# --- judging a streamed answer --------------------------------------------------------------------------  # noqa: E501
USAGE = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
ANSWER = [
    {"token_ids": [1733], "finish_reason": None, "completion_usage": USAGE},
    {"token_ids": [], "finish_reason": "length", "completion_usage": USAGE},
]


@pytest.mark.parametrize(
    ("chunks", "expected", "problem"),
    [
        (ANSWER, 1, None),
        ([{"token_ids": [5], "finish_reason": "length"}], 1, None),
        ([], 1, "the stream ended without a chunk"),
        (ANSWER[:1], 1, "no finish_reason on the last of 1 chunk(s)"),  # a stall after one token
        ([{"token_ids": [], "finish_reason": "length"}], 1, "0 token(s) in the stream, expected 1"),
        ([{"token_ids": [5], "finish_reason": "stop"}], 1, "finish_reason 'stop', expected 'length'"),  # noqa: E501
        ([{"token_ids": [5], "finish_reason": "length", "error": "boom"}], 1, "engine error in a chunk: boom"),  # noqa: E501
        ([ANSWER[0], {"finish_reason": "length"}], 1, "a chunk has no token_ids list"),
        (
            [{"token_ids": [5], "finish_reason": "length", "completion_usage": USAGE | {"completion_tokens": 2}}],  # noqa: E501
            1, "completion_usage.completion_tokens 2, expected 1",
        ),
        (["text"], 1, "a chunk is not a JSON object"),
    ],
)  # fmt: skip
def test_the_whole_stream_is_judged(chunks, expected, problem):
    assert stream_problem(chunks, expected) == problem


def test_a_users_payload_needs_only_a_finish_reason():
    assert stream_problem([{"token_ids": [], "finish_reason": "stop"}], None, exact=False) is None
    assert stream_problem([{"token_ids": [1]}], None, exact=False) is not None


# --- discovery and the worker's own /health, as evidence -------------------------------------------  # noqa: E501
def ok(at: float, identity: str | None = str(MOCKER)) -> Result:
    return Result(Outcome.SUCCESS, "ok", at, at + 0.01, 1e9 + at, "c", identity=identity)


def worker(at: float = 0.0) -> EndpointState:
    return apply_registration(EndpointState("generate", True, "why"), ok(at), POLICY)


def test_discovery_transitions():
    listed = on_discovery(DiscoveryState(), True, "i1", 1.0, "etcd")
    assert (listed.listed, listed.was_listed, listed.missing_since) == (True, True, None)
    gone = on_discovery(listed, False, "i1", 2.0, "etcd")
    assert (gone.listed, gone.missing_since) == (False, 2.0)
    assert on_discovery(gone, False, "i1", 3.0, "etcd").missing_since == 2.0  # the clock runs on
    assert on_discovery(gone, True, "i1", 4.0, "etcd").missing_since is None
    never = on_discovery(DiscoveryState(), False, "i1", 1.0, "etcd")
    assert (never.listed, never.missing_since) == (False, None)  # no clock: never listed
    other = on_discovery(gone, True, "i2", 5.0, "etcd")  # a new instance starts afresh
    assert (other.instance, other.missing_since, other.was_listed) == ("i2", None, True)
    assert on_discovery(gone, None, "i1", 5.0, "kubernetes").listed is None


def test_an_orphaned_worker_is_notready_and_its_clock_fails_liveness():
    ep = apply_discovery(worker(), True, "i1", 0.5, "file discovery (/srv/kv)")
    ep = apply_canary(ep, ok(0.6), ep.incarnation, POLICY)
    assert endpoint_verdict(ep, POLICY, 1.0).ready is True
    ep = apply_discovery(ep, False, "i1", 2.0, "file discovery (/srv/kv)")
    verdict = endpoint_verdict(ep, POLICY, 3.0)
    assert verdict.ready is False
    assert verdict.reason.startswith("not discoverable: i1 is gone from file discovery (/srv/kv)")
    assert canary_due(ep, POLICY) is None  # no way to it: no canary
    assert clocks(ep) == {Cause.UNDISCOVERABLE: 2.0}
    assert decide_liveness({"generate": ep}, 11.0, POLICY.liveness_window).live
    dead = decide_liveness({"generate": ep}, 12.0, POLICY.liveness_window)
    assert not dead.live
    assert dead.reason.startswith("generate: not discoverable for 10.0 s (window 10 s): not ")
    # Listed again: it proves itself anew before it is ready.
    back = apply_discovery(ep, True, "i1", 13.0, "file discovery (/srv/kv)")
    assert endpoint_verdict(back, POLICY, 13.0).ready is None
    assert canary_due(back, POLICY) == 13.0
    assert clocks(back) == {}


def test_a_worker_frozen_past_its_lease_is_named_not_discoverable_on_the_freezes_clock():
    ep = apply_discovery(worker(), True, "i1", 0.5, "file discovery (/srv/kv)")
    ep = apply_canary(ep, ok(0.6), ep.incarnation, POLICY)
    for at in (1.0, 2.0):  # frozen: its canaries time out, and the canary's clock starts
        late = Result(Outcome.TIMEOUT, "canary timeout", at, at + 0.5, 1e9 + at, "c")
        ep = apply_canary(ep, late, ep.incarnation, POLICY)
    hard = ep.canary.hard_since
    assert hard is not None
    assert clocks(ep) == {Cause.CANARY: hard}
    ep = apply_discovery(ep, False, "i1", 8.0, "file discovery (/srv/kv)")  # records expired
    assert canary_due(ep, POLICY) is None  # so the canary's clock can never end by itself
    live = decide_liveness({"generate": ep}, hard + 9.0, POLICY.liveness_window)
    assert live.live
    assert live.cause is Cause.UNDISCOVERABLE
    dead = decide_liveness({"generate": ep}, hard + 10.0, POLICY.liveness_window)
    assert not dead.live  # on the freeze's clock
    assert dead.cause is Cause.UNDISCOVERABLE
    assert dead.reason.startswith(
        f"generate: not discoverable for {hard + 2.0:.1f} s, after canary failing hard for 10.0 s"
    )


def test_a_worker_never_listed_is_notready_without_a_clock():
    ep = apply_discovery(worker(), False, "i1", 0.5, "etcd")
    verdict = endpoint_verdict(ep, POLICY, 1.0)
    assert verdict.ready is False
    assert "are not the worker's" in verdict.reason
    assert clocks(ep) == {}


def test_a_new_instance_is_a_new_incarnation_and_a_timeout_keeps_the_old_one():
    ep = apply_canary(worker(), ok(0.5), 1, POLICY)
    assert ep.incarnation == 1
    slow = Result(Outcome.TIMEOUT, "GET /metrics: no answer", 1.0, 1.5, 1e9, identity=str(MOCKER))
    ep = apply_registration(ep, slow, POLICY)
    ep = apply_registration(ep, ok(2.0), POLICY)
    assert ep.incarnation == 1
    assert ep.canary.ready is True
    restarted = apply_registration(
        ep, ok(3.0, identity="dynamo.backend.generate instance 1"), POLICY
    )
    assert restarted.incarnation == 2
    assert restarted.canary.ready is None  # it proves itself anew


def test_the_workers_own_503_is_shown_beside_a_ready_verdict_and_never_gates():
    ep = apply_canary(worker(), ok(0.5), 1, POLICY)
    ep = apply_engine_health(ep, False, "notready", "GET /health -> 503 (notready)", 0.6, 503)
    verdict = endpoint_verdict(ep, POLICY, 1.0)
    assert verdict.ready is True
    assert verdict.reason.endswith(
        "; the worker's own health route says GET /health -> 503 (notready)"
    )
    assert engine_undersells(ep)
    agrees = apply_engine_health(ep, True, "ready", "GET /health -> 200 (ready)", 0.7, 200)
    assert not engine_undersells(agrees)
    assert endpoint_verdict(agrees, POLICY, 1.0).reason == "canary passed in 10 ms"
