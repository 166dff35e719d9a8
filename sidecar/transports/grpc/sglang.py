"""SGLang's scheduler service (``sglang.grpc.scheduler.SglangScheduler``: SGLang run with
``--smg-grpc-mode`` on smg-grpc-servicer, gRPC only): ``Generate`` with tokenized input; the
engine's fake transfer (:class:`~sidecar.engines.base.FakeTransfer`) goes as
``disaggregated_params`` with SGLang's fake bootstrap host, as over HTTP (a decode server given
none crashes its scheduler; a prefill server waits for a peer).

SGLang's native service (``--grpc-port``, beside its HTTP server: ``sglang.runtime.v1.
SglangService``, SIDECAR_GRPC_SERVICE) takes the same request in its own messages: the ids, the
``rid``, and the same bootstrap fields; its streamed ``output_ids`` are cumulative and its finish
reason is JSON in ``meta_info`` (:class:`GrpcSglangNativeProber`). It publishes no Python stubs:
the messages the canary uses are declared in ``sglang_native_pb.py``, with SGLang 0.5.23's field
numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from sidecar.core.evidence.progress import ProgressSpec, Series
from sidecar.core.jsontext import loads as loads_json
from sidecar.core.vocabulary import Mode
from sidecar.engines.base import FakeTransfer
from sidecar.probes.base import CanaryRequest, token_ids
from sidecar.transports.grpc.base import FINISHED, GrpcProber

#: DisaggregatedParams.bootstrap_room is an int32 in the scheduler's service.
ROOM_BITS = 31


def colon_escaped(spec: ProgressSpec) -> ProgressSpec:
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
    service: ClassVar[str] = "sglang.grpc.scheduler.SglangScheduler"
    health_service: ClassVar[str | None] = ""
    room_bits: ClassVar[int] = ROOM_BITS
    # Its metrics, where it serves them (its side server): OpenMetrics, colons escaped.
    metrics_escaped: ClassVar[bool] = True

    @staticmethod
    def messages() -> None:
        from smg_grpc_proto.generated import sglang_scheduler_pb2  # noqa: F401

    def carried(self, request_id: str) -> dict[str, Any]:
        need = self.need
        if isinstance(need, FakeTransfer):
            return {
                "disaggregated_params": {
                    "bootstrap_host": need.host,
                    "bootstrap_port": need.port,
                    "bootstrap_room": need.room(request_id, self.room_bits),
                }
            }
        return {}

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_ids": token_ids()},
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": self.tokens,
                "ignore_eos": True,
            },
            "stream": False,
        } | self.carried(request_id)

    def answer(self, parsed: Any) -> str | None:
        # A decode canary's fake transfer brings no KV: what it generates is not reproducible.
        return None if self.role.mode is Mode.DECODE else super().answer(parsed)


#: SGLang's native gRPC service (``--grpc-port``).
NATIVE_SERVICE = "sglang.runtime.v1.SglangService"


def _finish_type(message: Mapping[str, Any]) -> str | None:
    """The finish reason's type from ``meta_info`` (a JSON text, "null" while unfinished)."""
    meta = message.get("meta_info")
    said = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    try:
        reason = loads_json(said) if isinstance(said, str) else None
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
    GetModelInfo. Its metrics are its HTTP server's /metrics, as over HTTP."""

    service: ClassVar[str] = NATIVE_SERVICE
    health_service: ClassVar[str | None] = None
    room_bits: ClassVar[int] = 63
    metrics_escaped: ClassVar[bool] = False

    @staticmethod
    def messages() -> None:
        from sidecar.transports.grpc import sglang_native_pb  # noqa: F401

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "rid": request_id,
            "input_ids": token_ids(),
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": self.tokens,
                "ignore_eos": True,
            },
            "stream": False,
        } | self.carried(request_id)

    def good_answer(self) -> str:
        return (
            "status OK, a finished message with meta_info finish_reason length or stop and "
            f"{self.tokens} token(s) in output_ids"
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

    def answer(self, parsed: Any) -> str | None:
        if self.role.mode is Mode.DECODE or not parsed:
            return None
        ids = parsed[-1].get("output_ids") or ()
        return " ".join(map(str, ids)) if ids else None

    def abort(self, request: CanaryRequest) -> CanaryRequest | None:
        rid = request.body.get("rid")
        if not isinstance(rid, str) or not rid:
            return None  # never abort_all: it would take every user's request with it
        body = {"rid": rid}
        return CanaryRequest("gRPC", f"/{self.service}/Abort", body, request.request_id, None)
