"""TensorRT-LLM's gRPC service (``trtllm.TrtllmService``, as TensorRT-LLM's own servicer serves
it for SGLang Model Gateway): ``Generate`` with tokenized input; the engine's local run
(:class:`~sidecar.engines.base.LocalRun`, DIS-1737) goes as ``disaggregated_params``
``REQUEST_TYPE_CONTEXT_AND_GENERATION``.

No TensorRT-LLM runs on this CPU: built from the proto (smg-grpc-proto 0.4.28) and tested on the
fake engine that serves it. Its registration is ``GetModelInfo`` (its server's grpc.health.v1
is not known).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sidecar.engines.base import LocalRun
from sidecar.probes.base import token_ids
from sidecar.transports.grpc.base import GrpcProber


class GrpcTrtllmProber(GrpcProber):
    service: ClassVar[str] = "trtllm.TrtllmService"
    ids_field: ClassVar[str] = "output_token_ids"

    @staticmethod
    def messages() -> None:
        from smg_grpc_proto.generated import trtllm_service_pb2  # noqa: F401

    def carried(self, request_id: str) -> dict[str, Any]:
        need = self.need
        if isinstance(need, LocalRun):  # the proto's enum: REQUEST_TYPE_ + the type, upper case
            return {
                "disaggregated_params": {
                    "request_type": f"REQUEST_TYPE_{need.request_type.upper()}"
                }
            }
        return {}

    def body(self, model: str | None, request_id: str) -> dict[str, Any]:
        return {
            "request_id": request_id,
            "tokenized": {"original_text": "", "input_token_ids": token_ids()},
            "sampling_config": {"temperature": 0},
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "streaming": False,
        } | self.carried(request_id)
