"""SGLang's scheduler service (``sglang.grpc.scheduler.SglangScheduler``: SGLang run with
``--smg-grpc-mode`` on smg-grpc-servicer, gRPC only): ``Generate`` with tokenized input;
prefill and decode carry ``disaggregated_params`` with SGLang's fake-transfer bootstrap host,
as over HTTP (a decode server given none crashes its scheduler; a prefill server waits for a
peer).

SGLang's native service (``--grpc-port``, beside its HTTP server: ``sglang.runtime.v1.
SglangService``, SIDECAR_GRPC_SERVICE) takes the same request in its own messages: the ids, the
``rid``, and the same bootstrap fields; its streamed ``output_ids`` are cumulative and its finish
reason is JSON in ``meta_info`` (:class:`GrpcSglangNativeProber`). It publishes no Python stubs:
the messages the canary uses are declared in ``sidecar/runtime/sglang_native_pb.py``, with SGLang
0.5.23's field numbers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from sidecar.core.evidence.progress import ProgressSpec, Series
from sidecar.probes.base import PROMPT_TOKEN_IDS, CanaryRequest, Prober, Role
from sidecar.probes.grpc.base import FINISHED, GrpcProber
from sidecar.probes.role import Backend, Mode
from sidecar.probes.sglang import FAKE_BOOTSTRAP_HOST, SglangProber, bootstrap_room

#: DisaggregatedParams.bootstrap_room is an int32 in this service.
ROOMS = 1 << 31


def _colon_escaped(spec: ProgressSpec) -> ProgressSpec:
    """SGLang's series as its --smg-grpc-mode side server serves them: OpenMetrics, whose
    sample names prometheus-client writes with the colon escaped (``sglang_num_running_reqs``
    for ``sglang:num_running_reqs``; measured on 0.5.23 with smg-grpc-servicer 0.14.1). The
    tokenizer manager's counters are not there (no tokenizer manager runs): the schedulers' are."""

    def each(group: tuple[Series, ...]) -> tuple[Series, ...]:
        return tuple(Series(s.name.replace(":", "_"), s.labels) for s in group)

    return replace(
        spec,
        running=each(spec.running),
        waiting=each(spec.waiting),
        peer_wait=each(spec.peer_wait),
        counters={category: each(group) for category, group in spec.counters.items()},
    )


class GrpcSglangProber(GrpcProber):
    backend: ClassVar[Backend] = Backend.SGLANG
    grpc_module: ClassVar[str] = "smg_grpc_proto.sglang_scheduler_pb2"
    service: ClassVar[str] = "sglang.grpc.scheduler.SglangScheduler"
    health_service: ClassVar[str | None] = ""
    http: ClassVar[type[Prober]] = SglangProber
    progress: ProgressSpec = _colon_escaped(SglangProber.progress)

    def __init__(self, bootstrap_port: int = 8998) -> None:
        self.bootstrap_port = bootstrap_port

    def why(self, role: Role) -> str:
        return SglangProber(self.bootstrap_port).why(role)

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        tokens = 2
        body: dict[str, Any] = {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_ids": list(PROMPT_TOKEN_IDS)},
            "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
            "stream": False,
        }
        if role.mode in (Mode.PREFILL, Mode.DECODE):
            body["disaggregated_params"] = {
                "bootstrap_host": FAKE_BOOTSTRAP_HOST,
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": bootstrap_room(request_id) % ROOMS,
            }
        return body, tokens

    def answer(self, parsed: Any, role: Role) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        return None if role.mode is Mode.DECODE else super().answer(parsed, role)


#: SGLang's native gRPC service (``--grpc-port``).
NATIVE_SERVICE = "sglang.runtime.v1.SglangService"


def _finish_type(message: Mapping[str, Any]) -> str | None:
    """The finish reason's type from ``meta_info`` (a JSON text, "null" while unfinished)."""
    meta = message.get("meta_info")
    said = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    try:
        reason = json.loads(said) if isinstance(said, str) else None
    except ValueError:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    return kind if isinstance(kind, str) else None


class GrpcSglangNativeProber(GrpcSglangProber):
    """SGLang's native service (``--grpc-port``): ``Generate{input_ids, sampling_params, rid,
    stream, disaggregated_params}``, answered with ``output_ids`` (cumulative when streamed: the
    last message holds them all), ``finished`` and ``meta_info.finish_reason`` as JSON
    (``{"type": "length", "length": 2}``). Its grpc.health.v1 is unimplemented (sgl-project/
    sglang #40129) and its HealthCheck echoes the last HTTP /health: registration is its
    GetModelInfo."""

    grpc_module: ClassVar[str] = "sidecar.runtime.sglang_native_pb"
    service: ClassVar[str] = NATIVE_SERVICE
    health_service: ClassVar[str | None] = None
    progress: ProgressSpec = SglangProber.progress  # its HTTP server's /metrics, as over HTTP

    def body(self, role: Role, model: str | None, request_id: str) -> tuple[dict[str, Any], int]:
        scheduler, tokens = super().body(role, model, request_id)
        sampling = scheduler["sampling_params"]
        body: dict[str, Any] = {
            "rid": request_id,
            "input_ids": scheduler["tokenized"]["input_ids"],
            "sampling_params": sampling,
            "stream": False,
        }
        if "disaggregated_params" in scheduler:
            params = dict(scheduler["disaggregated_params"])
            params["bootstrap_room"] = bootstrap_room(request_id)  # 64-bit here
            body["disaggregated_params"] = params
        return body, tokens

    def good_answer(self, role: Role) -> str:
        _, tokens = self.body(role, None, "x")
        return (
            "status OK, a finished message with meta_info finish_reason length or stop and "
            f"{tokens} token(s) in output_ids"
        )

    def problem(self, answer: Any, expected_tokens: int | None) -> str | None:
        if not isinstance(answer, list) or not answer:
            return "the call ended without a message"
        last = answer[-1]
        if not last.get("finished"):
            return f"no finished message in {len(answer)} message(s)"
        finish = _finish_type(last)
        if finish is None:
            return "no meta_info.finish_reason in the finished message"
        if finish not in FINISHED:
            return f"finish_reason {finish!r}: the engine did not finish the canary"
        got = len(last.get("output_ids") or ())
        if expected_tokens is not None and got != expected_tokens:
            return f"{got} token(s) in output_ids, expected {expected_tokens}"
        return None

    def generic_problem(self, answer: Any) -> str | None:
        return self.problem(answer, None)

    def answer(self, parsed: Any, role: Role) -> str | None:
        if role.mode is Mode.DECODE or not parsed:
            return None
        ids = parsed[-1].get("output_ids") or ()
        return " ".join(map(str, ids)) if ids else None

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        rid = request.body.get("rid")
        if not isinstance(rid, str) or not rid:
            return None  # never abort_all: it would take every user's request with it
        body = {"rid": rid}
        return CanaryRequest("gRPC", f"/{self.service}/Abort", body, request.request_id, None)
